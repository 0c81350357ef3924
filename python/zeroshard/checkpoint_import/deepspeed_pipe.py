"""Reads the weights and training state of a checkpoint written by DeepSpeed 0.19's PipelineEngine
(`engine.save_checkpoint(dir, tag)` makes `dir/<tag>/layer_<NN>[-model_00]-model_states.pt`, one per
layer that has a state_dict, and `mp_rank_<stage>_model_states.pt`, one per stage), without
importing deepspeed and without running code from its pickles (deepspeed.py's load_file). Under
ZeRO (or bf16) its optimizer state is read too, from each stage's ZeRO files
(`[bf16_]zero_pp_rank_<dp>_mp_rank_<stage>_optim_states.pt`, by deepspeed.py's reader)."""
import os
import re

import torch

from zeroshard.checkpoint_import.deepspeed import (ENGINE_KEYS, OPTIM_FILE_RE, DeepSpeedCheckpoint, load_file,
                                                   plain_value)
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
    are without a pipeline, by global layer index ("3.fc1.weight"), parameters and buffers alike (a
    state_dict, and DeepSpeed's load of one, does not tell them apart). A tied layer is in the file of
    each of its uses whose forward is the module itself (DeepSpeed writes none for a use through
    forward_fn); share_ties() names a tie's tensors by its first layer, as zeroshard does. Training
    state, LR scheduler and client_state come from stage 0's file.

    Optimizer state: under ZeRO-1 (or bf16) each stage's ZeRO files hold it as flat partitions per
    data-parallel rank, with the stage's parameter names (`param_shapes`: a layer's as above, a
    tie's as "tied_modules.<key>.<attr>" on every stage that uses it). optimizer_tensor() gives a
    parameter's fp32 master or state in the names above, a tie's from its first stage, once
    share_ties has been told which layer each key starts at. Without ZeRO DeepSpeed keeps it as a
    torch state_dict per stage, numbered by the stage's parameter order, which the files do not
    name: it is not read. `optimizer_unread` says why a saved optimizer state cannot be read (None
    when it can or there is none), so that a load that asks for it is refused, not dropped."""

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
        self.optimizer_saved = (any(n.endswith("_optim_states.pt") for n in names)
                                or any(state.get("optimizer") is not None for state in stage_files))
        self._zero, self._unread = self._zero_stages(names, stage_files)
        self._cached = (None, None)
        self._name_optimizer_state({})  # again by share_ties, with the run's tie keys

    def _zero_stages(self, names, stage_files):
        """(a ZeRO reader per stage, None) where the optimizer state can be read, else (None, why not)."""
        if not self.optimizer_saved:
            return None, None
        where = f"{self.path} is a DeepSpeed pipeline checkpoint (ZeRO stage {self.zero_stage}), "
        if not any(OPTIM_FILE_RE.match(n) for n in names):
            return None, where + ("whose optimizer state is a torch state_dict per stage numbered by the stage's "
                                  "parameter order, which its files do not name; zeroshard reads it only as "
                                  "ZeRO (or bf16) saves it")
        try:
            return [DeepSpeedCheckpoint(self.path, stage=s) for s in range(self.num_stages)], None
        except (ValueError, OSError) as error:  # the weights still load without it
            return None, where + f"whose optimizer files cannot be read: {error}"

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
        self._name_optimizer_state(keys or {})
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

    def _held(self, index, names):
        """{name within the layer: stored name} of layer `index`'s tensors (of `names` only, unless None)."""
        prefix = f"{index}."
        return {n[len(prefix):]: n for n in self._tensors
                if n.startswith(prefix) and (names is None or n[len(prefix):] in names)}

    def _name_optimizer_state(self, keys):
        """_optim_at: name -> (its stage's reader, the stage's name for it); _tie_unread: why not."""
        self._optim_at, self._tie_unread = {}, None
        for stage in self._zero or []:
            for name in stage.param_names:
                prefix = ".".join(name.split(".", 2)[:2])
                if name.startswith(_TIED) and prefix not in keys:
                    self._optim_at = {}
                    self._tie_unread = (
                        f"{self.path} is a DeepSpeed pipeline checkpoint, which keeps a tie's optimizer state "
                        f"under its TiedLayerSpec key ({prefix}), and this run has no TiedLayerSpec "
                        f"{prefix[len(_TIED):]!r} to say which layers that is: load it into a PipelineModule "
                        "built with the same TiedLayerSpecs")
                    return
                plain = keys[prefix] + name[len(prefix):] if name.startswith(_TIED) else name
                self._optim_at.setdefault(plain, (stage, name))

    @property
    def optimizer_unread(self):
        """Why the saved optimizer state cannot be read into this run; None when it can or there is none."""
        return self._unread or self._tie_unread

    @property
    def optimizer_state_names(self):
        return self._zero[0].optimizer_state_names if self._optim_at else []

    def has_optimizer_tensor(self, key):
        """key: "master/<name>" or "optim/<state>/<name>", in the names of the layers' tensors."""
        kind, _, rest = key.partition("/")
        if kind == "optim":
            state, _, rest = rest.partition("/")
            if state not in self.optimizer_state_names:
                return False
        return kind in ("master", "optim") and rest in self._optim_at

    def optimizer_tensor(self, key):
        """The full fp32 tensor of has_optimizer_tensor's `key` (the last one asked for is kept)."""
        if self._cached[0] != key:
            head, rest = key.rsplit("/", 1) if key.startswith("optim/") else key.split("/", 1)
            stage, name = self._optim_at[rest]
            self._cached = (key, stage.tensor(f"{head}/{name}"))
        return self._cached[1]

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
        zero = self._zero[0].sections() if self._optim_at else {}
        return {
            "training_state": {k: int(state[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                               if state.get(k) is not None},
            "lr_scheduler": plain_value(state.get("lr_scheduler")),
            "client_state": {k: plain_value(v, keep_tensors=True) for k, v in state.items() if k not in ENGINE_KEYS},
            "optimizer": zero.get("optimizer", {"type": None, "step": None, "param_groups": []}),
            "loss_scaler": zero.get("loss_scaler", {}),
        }
