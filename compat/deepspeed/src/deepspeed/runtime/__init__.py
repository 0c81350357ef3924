"""deepspeed.runtime: DeepSpeed's engine, ZeRO, pipeline, activation checkpointing and lr-schedule
modules, each zeroshard's own."""
from deepspeed._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, ("activation_checkpointing", "engine", "lr_schedules", "pipe", "zero"))
