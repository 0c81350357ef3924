"""Reads the weights and training state of a checkpoint written by DeepSpeed 0.19's PipelineEngine
(`engine.save_checkpoint(dir, tag)` makes `dir/<tag>/layer_<NN>-model_states.pt`, one per layer that
has a state_dict, and `mp_rank_<stage>_model_states.pt`, one per stage), without importing deepspeed
and without running code from its pickles (deepspeed.py's load_file). Its optimizer state is not
read (DeepSpeedPipelineCheckpoint says why)."""
import os
import re

import torch

from zeroshard.checkpoint_import.deepspeed import _ENGINE_KEYS, _plain, load_file
from zeroshard.dtypes import PRECISION_OF

__all__ = ["DeepSpeedPipelineCheckpoint", "is_deepspeed_pipeline_checkpoint"]

LAYER_FILE_RE = re.compile(r"^layer_(\d+)-model_states\.pt$")
STAGE_FILE_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# DeepSpeed's per-layer files of a pipeline that also has tensor parallelism: layer_03-model_01-...
_TENSOR_PARALLEL_RE = re.compile(r"^layer_\d+-.+-model_states\.pt$")


def is_deepspeed_pipeline_checkpoint(path):
    """True for a directory holding DeepSpeed's per-layer files. Reads names only."""
    return os.path.isdir(path) and any(LAYER_FILE_RE.match(n) or _TENSOR_PARALLEL_RE.match(n)
                                       for n in os.listdir(path))


class DeepSpeedPipelineCheckpoint:
    """A DeepSpeed pipeline checkpoint directory (`<load_dir>/<tag>`), opened and checked whole.

    Each layer file holds that layer's state_dict; its tensors are named as a PipelineModule's layers
    are without a pipeline, by global layer index ("3.fc1.weight"), parameters and buffers alike (the
    files do not tell them apart). A tied layer is in the file of each use that is the module itself
    (DeepSpeed skips a use through forward_fn), which is its first use in the models DeepSpeed's and
    Megatron's docs show. Training state, LR scheduler and client_state come from stage 0's file.

    The optimizer state is not read: without ZeRO DeepSpeed keeps it per stage as a torch
    state_dict numbered by the stage's parameter order, which the files do not name, and under ZeRO-1
    as flat partitions per stage and data-parallel rank. `optimizer_saved` says whether there is any,
    so that a load that asks for it is refused instead of dropping it."""

    def __init__(self, ckpt_dir):
        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
        self.path = ckpt_dir
        names = sorted(os.listdir(ckpt_dir))
        parallel = [n for n in names if _TENSOR_PARALLEL_RE.match(n) or n.startswith("expp_rank_")]
        if parallel:
            raise ValueError(f"{ckpt_dir}: {', '.join(parallel[:4])}: a pipeline checkpoint with tensor "
                             "parallelism or experts; only pipeline and data parallelism are read")
        stages = sorted(int(m.group(1)) for m in map(STAGE_FILE_RE.match, names) if m)
        if not stages or stages != list(range(len(stages))):
            raise FileNotFoundError(f"{ckpt_dir}: expected mp_rank_00_model_states.pt and one such file per "
                                    f"pipeline stage beside the layer files; found stages {stages or 'none'}")
        stage0_path = os.path.join(ckpt_dir, "mp_rank_00_model_states.pt")
        self._stage0 = load_file(stage0_path)
        if not isinstance(self._stage0, dict) or "module" not in self._stage0:
            raise ValueError(f"{stage0_path}: not a DeepSpeed model states file: expected a dict with 'module'")
        saved_stages = self._stage0.get("mp_world_size")
        if saved_stages is not None and int(saved_stages) != len(stages):
            raise FileNotFoundError(f"{ckpt_dir}: mp_world_size is {saved_stages} in {stage0_path} but there are "
                                    f"{len(stages)} mp_rank_*_model_states.pt files")
        self.num_stages = len(stages)
        self.data_parallel_size = int(self._stage0.get("dp_world_size") or 1)
        config = self._stage0.get("ds_config")
        zero = (config.get("zero_optimization") or {}) if isinstance(config, dict) else {}
        self.zero_stage = int(zero.get("stage") or 0) if isinstance(zero, dict) else 0
        self._tensors = {}
        for name in names:
            match = LAYER_FILE_RE.match(name)
            if match:
                self._read_layer(int(match.group(1)), os.path.join(ckpt_dir, name))
        floating = [t for t in self._tensors.values() if t.is_floating_point()]
        if not floating:
            raise ValueError(f"{ckpt_dir}: the layer files hold no floating-point tensor")
        if floating[0].dtype not in PRECISION_OF:
            raise ValueError(f"{ckpt_dir}: the layers are {floating[0].dtype}; expected float32, bfloat16 or "
                             "float16")
        self.dtype = PRECISION_OF[floating[0].dtype]
        self.optimizer_saved = (any(n.endswith("_optim_states.pt") for n in names)
                                or self._stage0.get("optimizer") is not None)

    def _read_layer(self, index, path):
        state = load_file(path)
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise ValueError(f"{path}: not a layer's state_dict (a dict of tensors)")
        for key, value in state.items():
            self._tensors[f"{index}.{key}"] = value

    @property
    def names(self):
        """Every stored tensor's name, in layer order."""
        return list(self._tensors)

    def tensor(self, name):
        return self._tensors[name]

    def sections(self):
        """Plain JSON values (client_state may also hold CPU tensors, as saved)."""
        state = self._stage0
        return {
            "training_state": {k: int(state[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                               if state.get(k) is not None},
            "lr_scheduler": _plain(state.get("lr_scheduler")),
            "client_state": {k: _plain(v, keep_tensors=True) for k, v in state.items() if k not in _ENGINE_KEYS},
        }
