"""deepspeed.runtime: DeepSpeed's engine, ZeRO, pipeline, activation checkpointing, lr-schedule,
dataloader and utils modules, each zeroshard's own (utils: the names scripts import from it)."""
from deepspeed._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, ("activation_checkpointing", "dataloader", "engine", "lr_schedules",
                                           "pipe", "utils", "zero"))
