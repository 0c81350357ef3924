"""deepspeed.runtime.pipe: DeepSpeed's pipeline modules, each zeroshard's own (module, topology,
engine), and the four names DeepSpeed's package exports. Its schedule module is refused
(deepspeed/_unsupported.py): zeroshard's schedules are built in C++."""
from deepspeed._lazy import submodule_getattr
# DeepSpeed's package exports these four.
from zeroshard.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec  # noqa: F401

__getattr__ = submodule_getattr(__name__, ("engine", "module", "topology"))
