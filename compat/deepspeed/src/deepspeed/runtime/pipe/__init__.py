"""deepspeed.runtime.pipe: DeepSpeed's pipeline modules, each zeroshard's own
(module, topology, engine)."""
from deepspeed._lazy import submodule_getattr
from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401 (DeepSpeed re-exports them)

__getattr__ = submodule_getattr(__name__, ("engine", "module", "topology"))
