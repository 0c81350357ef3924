"""Reads the weights and training state of a checkpoint written by DeepSpeed 0.19's PipelineEngine
(`engine.save_checkpoint(dir, tag)` makes `dir/<tag>/layer_<NN>[-model_00]-model_states.pt`, one per
layer that has a state_dict, and `mp_rank_<stage>_model_states.pt`, one per stage), without
importing deepspeed and without running code from its pickles (deepspeed.py's load_file). Its
optimizer state is not read (DeepSpeedPipelineCheckpoint says why)."""
import os
import re

import torch

from zeroshard.checkpoint_import.deepspeed import ENGINE_KEYS, load_file, plain_value
from zeroshard.dtypes import PRECISION_OF

__all__ = ["DeepSpeedPipelineCheckpoint", "is_deepspeed_pipeline_checkpoint"]

# layer_<index>[-model_<tensor-parallel rank>]-model_states.pt: Megatron-DeepSpeed and GPT-NeoX lay
# their pipelines out with a model axis (PipeModelDataParallelTopology), so their files carry
# "-model_00" even without tensor parallelism.
LAYER_FILE_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
STAGE_FILE_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_TIED = "tied_modules."


def is_deepspeed_pipeline_checkpoint(path):
    """True for a directory holding DeepSpeed's per-layer files. Reads names only."""
    return os.path.isdir(path) and any(LAYER_FILE_RE.match(n) for n in os.listdir(path))


class DeepSpeedPipelineCheckpoint:
    """A DeepSpeed pipeline checkpoint directory (`<load_dir>/<tag>`), opened and checked whole.

    Each layer file holds that layer's state_dict; its tensors are named as a PipelineModule's layers
    are without a pipeline, by global layer index ("3.fc1.weight"). A tied layer is in the file of
    each of its uses whose forward is the module itself (DeepSpeed writes none for a use through
    forward_fn); share_ties() names all of a tie's tensors by its first layer, as zeroshard does.
    The stage files name the buffers; training state, LR scheduler and client_state come from stage
    0's.

    The optimizer state is not read: without ZeRO DeepSpeed keeps it per stage as a torch
    state_dict numbered by the stage's parameter order, which the files do not name, and under ZeRO-1
    as flat partitions per stage and data-parallel rank. `optimizer_saved` says whether there is any,
    so that a load that asks for it is refused instead of dropping it."""

    def __init__(self, ckpt_dir):
        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
        self.path = ckpt_dir
        names = os.listdir(ckpt_dir)
        layer_files = {}  # layer index -> file
        for name in names:
            match = LAYER_FILE_RE.match(name)
            if match and int(match.group(2) or 0) > 0:
                ranks = 1 + max(int(m.group(2) or 0) for m in map(LAYER_FILE_RE.match, names) if m)
                raise ValueError(f"{ckpt_dir}: {name}: a pipeline checkpoint with tensor parallelism (model "
                                 f"ranks 0-{ranks - 1}); only pipeline and data parallelism are read")
            if match:
                layer_files[int(match.group(1))] = name
        experts = [n for n in names if n.startswith("expp_rank_") or re.match(r"^layer_\d+_expert_", n)]
        if experts:
            raise ValueError(f"{ckpt_dir}: {', '.join(sorted(experts)[:4])}: a checkpoint with experts (MoE); "
                             "only pipeline and data parallelism are read")
        stages = sorted(int(m.group(1)) for m in map(STAGE_FILE_RE.match, names) if m)
        if not stages or stages != list(range(len(stages))):
            raise FileNotFoundError(f"{ckpt_dir}: expected mp_rank_00_model_states.pt and one such file per "
                                    f"pipeline stage beside the layer files; found stages {stages or 'none'}")
        stage_files = [self._stage_file(os.path.join(ckpt_dir, f"mp_rank_{s:02d}_model_states.pt")) for s in stages]
        self._stage0 = stage_files[0]
        saved_stages = self._stage0.get("mp_world_size")
        if saved_stages is not None and int(saved_stages) != len(stages):
            raise ValueError(f"{ckpt_dir}: mp_world_size is {saved_stages} in mp_rank_00_model_states.pt but "
                             f"there are {len(stages)} mp_rank_*_model_states.pt files")
        self.num_stages = len(stages)
        self.data_parallel_size = int(self._stage0.get("dp_world_size") or 1)
        config = self._stage0.get("ds_config")
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        self.zero_stage = int(zero.get("stage") or 0) if isinstance(zero, dict) else 0
        self._tensors = {}  # "<layer index>.<name>" -> tensor, in layer order
        for index in sorted(layer_files):
            self._read_layer(index, os.path.join(ckpt_dir, layer_files[index]))
        # As PipelineModule names them: "3.bn.running_mean", "tied_modules.<key>.<name>".
        self._buffer_names = {n for state in stage_files for n in (state.get("buffer_names") or [])}
        floating = [t for t in self._tensors.values() if t.is_floating_point()]
        if not floating:
            raise ValueError(f"{ckpt_dir}: the layer files hold no floating-point tensor")
        if floating[0].dtype not in PRECISION_OF:
            raise ValueError(f"{ckpt_dir}: the layers are {floating[0].dtype}; expected float32, bfloat16 or "
                             "float16")
        self.dtype = PRECISION_OF[floating[0].dtype]
        self.optimizer_saved = (any(n.endswith("_optim_states.pt") for n in names)
                                or any(state.get("optimizer") is not None for state in stage_files))

    @staticmethod
    def _stage_file(path):
        state = load_file(path)
        if not isinstance(state, dict) or "module" not in state:
            raise ValueError(f"{path}: not a DeepSpeed model states file: expected a dict with 'module'")
        return state

    def _read_layer(self, index, path):
        state = load_file(path)
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise ValueError(f"{path}: not a layer's state_dict (a dict of tensors)")
        for key, value in state.items():
            self._tensors[f"{index}.{key}"] = value

    def share_ties(self, ties):
        """ties: the layer indices of each tie, first use first (what the model says: the files do
        not). Each tie's tensors are named by its first layer, read from the first of its uses that
        has a file; another use's file must hold the same values."""
        for layers in ties:
            layers = sorted(layers)
            stored = [i for i in layers if any(n.startswith(f"{i}.") for n in self._tensors)]
            if not stored:
                continue
            source = stored[0]
            kept = {n[len(f"{source}."):]: t for n, t in self._tensors.items() if n.startswith(f"{source}.")}
            for other in stored[1:]:
                for rest, value in kept.items():
                    again = self._tensors.pop(f"{other}.{rest}", None)
                    if again is not None and not torch.equal(again, value):
                        raise ValueError(f"{self.path}: layers {source} and {other} are one tied module, but "
                                         f"their files hold different {rest!r}")
            if source != layers[0]:
                self._tensors = {(f"{layers[0]}.{n[len(f'{source}.'):]}" if n.startswith(f"{source}.") else n): t
                                 for n, t in self._tensors.items()}
        self._ties = [sorted(layers) for layers in ties]

    @property
    def names(self):
        """Every stored tensor's name."""
        return list(self._tensors)

    def has(self, name):
        return name in self._tensors

    def tensor(self, name):
        return self._tensors[name]

    def is_buffer(self, name):
        """Whether a stored tensor is a buffer, by the stage files' buffer_names (a tie's, named
        tied_modules.<key>.<name> there, match any tied layer's <name>)."""
        if name in self._buffer_names:
            return True
        index, rest = name.split(".", 1)
        tied = any(int(index) in layers for layers in getattr(self, "_ties", ()))
        return tied and any(b.startswith(_TIED) and b.split(".", 2)[2] == rest for b in self._buffer_names)

    def sections(self):
        """Plain JSON values (client_state may also hold CPU tensors, as saved)."""
        state = self._stage0
        return {
            "training_state": {k: int(state[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                               if state.get(k) is not None},
            "lr_scheduler": plain_value(state.get("lr_scheduler")),
            "client_state": {k: plain_value(v, keep_tensors=True) for k, v in state.items() if k not in ENGINE_KEYS},
        }
