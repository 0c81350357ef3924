"""zeroshard: ZeRO sharding, offload and pipeline runtime for PyTorch, driven by DeepSpeed's
ds_config.json. DeepSpeed scripts run unchanged with `import zeroshard as deepspeed`.

Names are imported on first use, so the `zeroshard` launcher starts without importing torch."""
import importlib

__version__ = "0.1.0"

# public name -> (module, attribute)
_LAZY = {
    "initialize": ("zeroshard.engine", "initialize"),
    "ZeroShardEngine": ("zeroshard.engine", "ZeroShardEngine"),
    "DeepSpeedEngine": ("zeroshard.engine", "ZeroShardEngine"),
    "init_distributed": ("zeroshard.comm", "init_distributed"),
    "add_config_arguments": ("zeroshard.config", "add_config_arguments"),
    # DeepSpeed's top level has both (Megatron-DeepSpeed: isinstance(model, deepspeed.PipelineEngine)).
    "PipelineModule": ("zeroshard.pipe", "PipelineModule"),
    "PipelineEngine": ("zeroshard.pipe.engine", "PipelineEngine"),
    # The memory planner (zeroshard/planner): every setup's bytes per GPU and node, and which fits.
    "plan": ("zeroshard.planner", "plan"),
}

# Submodules DeepSpeed scripts reach as attributes (deepspeed.comm.get_rank(), deepspeed.ops.adam...).
_SUBMODULES = ("comm", "ops", "launcher", "config", "engine", "zero", "utils", "pipe", "checkpointing")

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"zeroshard.{name}")
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")


def __dir__():
    return __all__
