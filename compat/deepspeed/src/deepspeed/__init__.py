"""zeroshard under DeepSpeed's module paths: the `deepspeed` compatibility distribution built from
compat/deepspeed (docs/deepspeed-compat.md). Leaf modules are zeroshard's own module objects, so a
patch applied to deepspeed.x reaches zeroshard; packages re-export zeroshard's names.

Names are imported on first use, as in zeroshard, so `import deepspeed` does not import torch."""
import zeroshard as _zeroshard
from deepspeed._lazy import submodule_getattr as _submodule_getattr
from deepspeed._unsupported import refuse_call as _refuse_call
from deepspeed._version import __version__

version = __version__

# This package's own submodules that DeepSpeed scripts reach as attributes (deepspeed.zero.Init).
_SUBMODULES = ("accelerator", "checkpoint", "checkpointing", "comm", "launcher", "ops", "pipe", "runtime",
               "utils", "zero")


def tp_model_init(*args, **kwargs):
    _refuse_call("deepspeed.tp_model_init")


def init_inference(*args, **kwargs):
    _refuse_call("deepspeed.init_inference")


__all__ = sorted(set(_zeroshard.__all__) | {"version", "tp_model_init", "init_inference"})


def _from_zeroshard(name):
    try:
        value = getattr(_zeroshard, name)
    except AttributeError:
        raise AttributeError(f"module 'deepspeed' (zeroshard's compatibility package) has no "
                             f"attribute {name!r}") from None
    globals()[name] = value
    return value


__getattr__ = _submodule_getattr(__name__, _SUBMODULES, _from_zeroshard)


def __dir__():
    return sorted(set(__all__) | set(_SUBMODULES))
