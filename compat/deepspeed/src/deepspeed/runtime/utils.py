"""deepspeed.runtime.utils: the names of it that training scripts import (DeepSpeedExamples'
pipeline and AlexNet scripts, Megatron-DeepSpeed's pretrain scripts, DeepSpeed's own tests):
RepeatingLoader, set_random_seed and see_memory_usage, zeroshard.utils' own. Its other names
are missing (an AttributeError that says so)."""
from deepspeed._lazy import submodule_getattr
from zeroshard.utils import RepeatingLoader, see_memory_usage, set_random_seed  # noqa: F401

__all__ = ["RepeatingLoader", "see_memory_usage", "set_random_seed"]
__getattr__ = submodule_getattr(__name__, ())
