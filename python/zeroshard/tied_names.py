"""How a pipeline names a tie's tensors. PipelineModule (pipe/module.py), like DeepSpeed's, keeps
each TiedLayerSpec's module at `tied_modules.<key>` on every stage that uses it; checkpoints
(checkpoint/pipeline.py) and the DeepSpeed pipeline import (checkpoint_import/deepspeed_pipe_optim.py)
read such names through this module."""

TIED_MODULES = "tied_modules."


def tie_prefix(name):
    """"tied_modules.<key>" for a name under a tie's module, else None."""
    parts = name.split(".", 2)
    return f"{parts[0]}.{parts[1]}" if name.startswith(TIED_MODULES) and len(parts) > 1 else None
