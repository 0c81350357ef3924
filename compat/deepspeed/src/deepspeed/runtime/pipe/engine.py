"""deepspeed.runtime.pipe.engine is zeroshard.pipe.engine itself (one module object)."""
import sys

import zeroshard.pipe.engine as _module

sys.modules[__name__] = _module
