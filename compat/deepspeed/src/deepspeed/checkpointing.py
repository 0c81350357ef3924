"""deepspeed.checkpointing (DeepSpeed's alias of runtime.activation_checkpointing.checkpointing) is
zeroshard.checkpointing itself (one module object)."""
import sys

import zeroshard.checkpointing as _module

sys.modules[__name__] = _module
