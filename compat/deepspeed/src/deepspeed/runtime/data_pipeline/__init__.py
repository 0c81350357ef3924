"""deepspeed.runtime.data_pipeline: the curriculum scheduler's name only (GPT-NeoX imports it at the
top of its training module); zeroshard has no data-efficiency pipeline."""
from deepspeed._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, ("curriculum_scheduler",))
