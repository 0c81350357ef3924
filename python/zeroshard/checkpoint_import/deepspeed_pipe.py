"""Reads the weights and training state of a checkpoint written by DeepSpeed 0.19's PipelineEngine
(`engine.save_checkpoint(dir, tag)` makes `dir/<tag>/layer_<NN>[-model_00]-model_states.pt`, one per
layer that has a state_dict, and `mp_rank_<stage>_model_states.pt`, one per stage), without
importing deepspeed and without running code from its pickles (deepspeed.py's load_file). Under
ZeRO-1 its optimizer state is read too (deepspeed_pipe_optim.py)."""
import os
import re

import torch

from zeroshard.checkpoint_import.deepspeed import ENGINE_KEYS, load_file, plain_value
from zeroshard.checkpoint_import.deepspeed_pipe_optim import PipelineOptimizerState
from zeroshard.dtypes import PRECISION_OF

__all__ = ["DeepSpeedPipelineCheckpoint", "is_deepspeed_pipeline_checkpoint"]

# layer_<index>[-model_<tensor-parallel rank>]-model_states.pt: Megatron-DeepSpeed and GPT-NeoX lay
# their pipelines out with a model axis (PipeModelDataParallelTopology), so their files carry
# "-model_00" even without tensor parallelism.
LAYER_FILE_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
STAGE_FILE_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def is_deepspeed_pipeline_checkpoint(path):
    """True for a directory holding DeepSpeed's per-layer files. Reads names only."""
    return os.path.isdir(path) and any(LAYER_FILE_RE.match(n) for n in os.listdir(path))


class DeepSpeedPipelineCheckpoint:
    """A DeepSpeed pipeline checkpoint directory (`<load_dir>/<tag>`), opened and checked whole.

    Each layer file holds that layer's state_dict; its tensors are named as a PipelineModule's layers
    are without a pipeline, by global layer index ("3.fc1.weight"), parameters and buffers alike (a
    state_dict, and DeepSpeed's load of one, does not tell them apart). A tied layer is in the file of
    each of its uses whose forward is the module itself (DeepSpeed writes none for a use through
    forward_fn); share_ties() names a tie's tensors by its first layer, as zeroshard does. Training
    state, LR scheduler and client_state come from stage 0's file.

    `optimizer` (deepspeed_pipe_optim.PipelineOptimizerState) gives the fp32 masters and optimizer
    state in the same names, under ZeRO-1, once share_ties has been told the run's tie keys; its
    `unread` says why not otherwise (None when it can be read or none was saved), so that a load
    that asks for it is refused, not dropped."""

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
                                 f"ranks 0-{ranks - 1}); only pipeline and data parallelism are read: merge its "
                                 "tensor-parallel ranks into one (model_00) first")
            if match:
                index = int(match.group(1))
                if index in layer_files:
                    raise ValueError(f"{ckpt_dir}: {layer_files[index]} and {name}: two files for layer {index} "
                                     "(files of two saves in one tag directory?)")
                layer_files[index] = name
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
        elements = {}  # floating dtype -> elements: the weights' dtype has the most
        for t in self._tensors.values():
            if t.is_floating_point():
                elements[t.dtype] = elements.get(t.dtype, 0) + t.numel()
        if not elements:
            raise ValueError(f"{ckpt_dir}: the layer files hold no floating-point tensor")
        dtype = max(elements, key=elements.get)
        if dtype not in PRECISION_OF:
            raise ValueError(f"{ckpt_dir}: the layers are {dtype}; expected float32, bfloat16 or float16")
        self.dtype = PRECISION_OF[dtype]
        self.optimizer = PipelineOptimizerState(ckpt_dir, names, stage_files, self.zero_stage)
        self.optimizer.bind_tie_keys({}, self._tensors.get)  # again by share_ties, with the run's tie keys

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

    def share_ties(self, ties, keys=None):
        """ties: [(layer indices, names)] of each tie, as the model ties them (the files do not say):
        names None for a tied module (all of its tensors), else the tensor names within the layers
        that are one tensor ("weight" for layers 1 and 3). A tie's tensors are named by its first
        layer, read from the first of its layers that has them; another layer's copy must hold the
        same values. keys: {"tied_modules.<key>": "<its first layer>"}, the run's TiedLayerSpec keys
        (a pipeline run's; none without one), which name a tie's optimizer state."""
        for layers, names in ties:
            layers = sorted(layers)
            stored = [i for i in layers if self._held(i, names)]
            if not stored:
                continue
            source, kept = stored[0], self._held(stored[0], names)
            for other in stored[1:]:
                for rest, name in self._held(other, names).items():
                    if rest in kept:
                        if not torch.equal(self._tensors.pop(name), self._tensors[kept[rest]]):
                            raise ValueError(f"{self.path}: layers {source} and {other} share {rest!r}, but "
                                             "their files hold different values")
            if source != layers[0]:
                renamed = {name: f"{layers[0]}.{rest}" for rest, name in kept.items()}
                self._tensors = {renamed.get(n, n): t for n, t in self._tensors.items()}
        self.optimizer.bind_tie_keys(keys or {}, self._tensors.get)

    def _held(self, index, names):
        """{name within the layer: stored name} of layer `index`'s tensors (of `names` only, unless None)."""
        prefix = f"{index}."
        return {n[len(prefix):]: n for n in self._tensors
                if n.startswith(prefix) and (names is None or n[len(prefix):] in names)}

    @property
    def names(self):
        """Every stored tensor's name."""
        return list(self._tensors)

    def has(self, name):
        return name in self._tensors

    def tensor(self, name):
        return self._tensors[name]

    def sections(self):
        """Plain JSON values (client_state may also hold CPU tensors, as saved)."""
        state = self._stage0
        return {
            "training_state": {k: int(state[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                               if state.get(k) is not None},
            "lr_scheduler": plain_value(state.get("lr_scheduler")),
            "client_state": {k: plain_value(v, keep_tensors=True) for k, v in state.items() if k not in ENGINE_KEYS},
            **self.optimizer.sections(),
        }
