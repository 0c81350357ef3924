"""deepspeed.runtime.zero (also deepspeed.zero): zeroshard.zero's names (Init, GatheredParameters,
register_external_parameter); partition_parameters is zeroshard.zero.partition_init."""
import zeroshard.zero as _zero
from deepspeed._lazy import submodule_getattr
from zeroshard.zero import *  # noqa: F401,F403

__all__ = list(_zero.__all__)
__getattr__ = submodule_getattr(__name__, ("partition_parameters", "stage3", "stage_1_and_2"))
