"""deepspeed.runtime.pipe.topology is zeroshard.pipe.topology itself (one module object)."""
import sys

import zeroshard.pipe.topology as _module

sys.modules[__name__] = _module
