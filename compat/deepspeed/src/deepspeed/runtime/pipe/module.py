"""deepspeed.runtime.pipe.module is zeroshard.pipe.module itself (one module object)."""
import sys

import zeroshard.pipe.module as _module

sys.modules[__name__] = _module
