"""deepspeed.utils: zeroshard.utils' names (the safe_get_full_* / safe_set_full_* helpers, logger,
RepeatingLoader, set_random_seed, see_memory_usage);
zero_to_fp32 is zeroshard.utils.zero_to_fp32. Process groups (groups) are not supported."""
import zeroshard.utils as _utils
from deepspeed._lazy import submodule_getattr
from zeroshard.utils import *  # noqa: F401,F403

__all__ = list(_utils.__all__)
__getattr__ = submodule_getattr(__name__, ("zero_to_fp32",))
