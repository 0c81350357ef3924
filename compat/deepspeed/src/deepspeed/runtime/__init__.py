"""deepspeed.runtime: DeepSpeed's engine, ZeRO, pipeline, activation checkpointing, lr-schedule,
dataloader and utils modules, each zeroshard's own (utils: the names scripts import from it), and
the bf16 optimizer and curriculum scheduler as names whose construction is refused."""
from deepspeed._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, ("activation_checkpointing", "bf16_optimizer", "data_pipeline", "dataloader",
                                           "engine", "lr_schedules", "pipe", "utils", "zero"))
