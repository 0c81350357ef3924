"""deepspeed.runtime.dataloader is zeroshard.dataloader itself (one module object): RepeatingLoader
where DeepSpeed defines it."""
import sys

import zeroshard.dataloader as _module

sys.modules[__name__] = _module
