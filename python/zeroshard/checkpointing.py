"""DeepSpeed's activation checkpointing API (deepspeed.checkpointing): checkpoint(function, *args)
keeps only a segment's inputs and runs it again in backward (torch.utils.checkpoint's
non-reentrant form underneath); with cpu_checkpointing the kept inputs wait in host memory.
configure() reads the config's activation_checkpointing block or its keyword overrides."""
import contextlib
import json
import os

import torch
import torch.utils.checkpoint

from zeroshard.log import log_rank0

_settings = {"cpu_checkpointing": False, "configured": False}


def checkpoint(function, *args):
    """function(*args), its activations recomputed in backward instead of kept."""
    keep = contextlib.nullcontext()
    if _settings["cpu_checkpointing"]:
        keep = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    with keep:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _block_from(deepspeed_config):
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, dict):
        config = deepspeed_config
    else:
        from zeroshard import _C
        with open(deepspeed_config) as f:
            text = f.read()
        config = json.loads(_C.parse_config(text, str(deepspeed_config)).resolved_json())
    return config.get("activation_checkpointing", {}) or {}


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """DeepSpeed's configure: the config's block, then the keyword arguments over it. Options
    that would change where activations live in ways zeroshard does not implement are errors."""
    block = _block_from(deepspeed_config)
    partition = block.get("partition_activations", False) if partition_activations is None else partition_activations
    contiguous = (block.get("contiguous_memory_optimization", False) if contiguous_checkpointing is None
                  else contiguous_checkpointing)
    if partition:
        raise ValueError("checkpointing.configure: partition_activations splits activations over "
                         "tensor-parallel ranks, which zeroshard does not have")
    if contiguous:
        raise ValueError("checkpointing.configure: contiguous_memory_optimization "
                         "(contiguous_checkpointing) is not supported")
    cpu = block.get("cpu_checkpointing", False) if checkpoint_in_cpu is None else checkpoint_in_cpu
    # Timing and buffer-count options, which change nothing here: said, not dropped silently.
    for key, value in (("synchronize_checkpoint_boundary", synchronize), ("profile", profile),
                       ("number_checkpoints", num_checkpoints)):
        value = block.get(key) if value is None else value
        if value not in (None, False):
            log_rank0(f"warning: checkpointing.configure: {key}={value!r} has no effect in zeroshard "
                      "(no device synchronization, profiling or preallocated checkpoint buffers)",
                      int(os.environ.get("RANK", "0")))
    _settings.update(cpu_checkpointing=bool(cpu), configured=True)


def is_configured():
    return _settings["configured"]


def reset():
    """DeepSpeed resets its buffers between iterations; zeroshard keeps none."""
