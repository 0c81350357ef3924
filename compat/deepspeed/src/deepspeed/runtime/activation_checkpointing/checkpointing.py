"""deepspeed.runtime.activation_checkpointing.checkpointing (deepspeed.checkpointing) is
zeroshard.checkpointing itself (one module object)."""
import sys

import zeroshard.checkpointing as _module

sys.modules[__name__] = _module
