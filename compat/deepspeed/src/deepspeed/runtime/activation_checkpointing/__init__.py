"""deepspeed.runtime.activation_checkpointing: its checkpointing module is zeroshard's."""
from deepspeed._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, ("checkpointing",))
