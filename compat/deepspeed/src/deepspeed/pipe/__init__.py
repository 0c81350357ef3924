"""deepspeed.pipe is zeroshard.pipe itself (one module object, so that patches applied here
reach zeroshard): PipelineModule, LayerSpec, TiedLayerSpec, the topologies."""
import sys

import zeroshard.pipe as _module

sys.modules[__name__] = _module
