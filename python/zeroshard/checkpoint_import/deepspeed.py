"""Reads a ZeRO-1/2/3 checkpoint directory written by DeepSpeed 0.19 (`engine.save_checkpoint(dir, tag)`
makes `dir/<tag>/*_model_states.pt` and `*_optim_states.pt`) into full CPU tensors and plain sections,
without importing deepspeed and without running code from its pickles."""
import enum
import math
import os
import pickle
import re
import zipfile

import torch

from zeroshard.dtypes import PRECISION_OF

__all__ = ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "load_file",
           "ALLOWED_GLOBALS"]

# mp_rank_00_model_states.pt (stage 0-2), zero_pp_rank_<dp>_mp_rank_00_model_states.pt (stage 3),
# [bf16_]zero_pp_rank_<dp>_mp_rank_00_optim_states.pt (one per data-parallel rank).
MODEL_FILE_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


# Stand-ins for the DeepSpeed classes its pickles name. The unpickler builds these plain holders in
# their place (class + attribute dict), so nothing from deepspeed is imported or run.
class ZeroStageEnum(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum"""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler:
    """deepspeed.runtime.fp16.loss_scaler.LossScaler: attributes cur_scale, dynamic."""


class DynamicLossScaler(LossScaler):
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler: cur_scale, cur_iter, scale_window, ..."""


class FragmentAddress:
    """deepspeed.utils.tensor_fragment.fragment_address: numel, start of a parameter in a partition."""


# What the loader lets the pickles name beyond torch's own weights_only set (tensors, torch.Size,
# dtypes, OrderedDict): DeepSpeed's data classes, each mapped to its stand-in. No function.
ALLOWED_GLOBALS = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]

# Keys DeepSpeed writes into a model states file; the rest is the user's client_state.
ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers", "autoep_layers",
}
_GLOBAL_IN_ERROR_RE = re.compile(r"GLOBAL ([\w.]+)")


def load_file(path):
    """One DeepSpeed file as plain containers and CPU tensors, or a ValueError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    # torch.save has written zip archives since torch 1.6 and DeepSpeed 0.19 uses it; refusing other
    # formats keeps the legacy pickle reader out, and a truncated archive fails here.
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a torch.save archive (no zip directory): truncated, corrupted, "
                         "or not a file DeepSpeed wrote")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            state = None if unsafe else torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        match = _GLOBAL_IN_ERROR_RE.search(str(e))
        if match:
            raise ValueError(f"{path}: refused: its pickle names {match.group(1)}, which is not on the allow-list; "
                             "loading code from a checkpoint is refused") from None
        raise ValueError(f"{path}: torch.load(weights_only=True) refused it: {_last_line(e)}") from None
    except Exception as e:  # a damaged archive fails in zip, pickle or text decoding: all mean the same
        raise ValueError(f"{path}: cannot be read as a torch.save archive, it may be truncated or corrupted: "
                         f"{type(e).__name__}: {_last_line(e)}") from e
    if unsafe:
        raise ValueError(f"{path}: refused: its pickle names {', '.join(sorted(unsafe))}, which is not on the "
                         "allow-list (torch's tensor types and DeepSpeed's data classes); loading code from a "
                         "checkpoint is refused")
    return state


def _last_line(error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def is_deepspeed_checkpoint(path):
    """True for a DeepSpeed tag directory holding *_model_states.pt / *_optim_states.pt files, or for
    one such file. Reads names only."""
    def known(name):
        return bool(MODEL_FILE_RE.match(name) or OPTIM_FILE_RE.match(name))
    if os.path.isdir(path):
        return any(known(name) for name in os.listdir(path))
    return os.path.isfile(path) and known(os.path.basename(path))


class _Slot:
    """Where one trainable parameter lives: flat group, offset (in the group's concatenation over ranks
    for stages 1/2, inside each rank's partition for stage 3), shape."""

    def __init__(self, group, offset, shape):
        self.group, self.offset, self.shape = group, offset, torch.Size(shape)
        self.numel = math.prod(self.shape)


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint directory (`<load_dir>/<tag>`). Construction opens and checks every
    file; tensor data is memory-mapped and read when a tensor is asked for, so the files must not be
    rewritten in place while it is in use (replacing them by rename is fine).

    tensor("param/<n>"), tensor("master/<n>"), tensor("optim/<state>/<n>"), tensor("buffer/<n>") give
    full CPU tensors; sections() gives the training state, loss scaler, LR scheduler, client_state and
    optimizer hyper-parameters.

    stage: None for a data-parallel checkpoint (mp_rank_00 only); a pipeline stage's index to read
    that stage's ZeRO files (mp_rank_<stage>) of a PipelineEngine checkpoint, whose weights are in
    its layer files instead (deepspeed_pipe.py): there only master/ and optim/ tensors are read."""

    def __init__(self, ckpt_dir, stage=None):
        self.path = ckpt_dir
        self._stage = stage
        self._groups_of = None  # param_groups_of's, made once
        self._mp = f"mp_rank_{stage or 0:02d}"
        model_paths, optim_paths, optim0 = self._find_files(ckpt_dir)
        self._model = [self._checked_model(load_file(p), p) for p in model_paths]
        self._optim = [optim0] + [self._checked_optim(load_file(p), p) for p in optim_paths[1:]]
        self._optim_paths = optim_paths
        self._read_layout()

    # ---- files -------------------------------------------------------------------------------------
    def _find_files(self, ckpt_dir):
        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
        names = sorted(os.listdir(ckpt_dir))
        mine = f"{self._mp}_"
        models = [n for n in names if MODEL_FILE_RE.match(n) and (self._stage is None or mine in n)]
        optims = [n for n in names if OPTIM_FILE_RE.match(n) and (self._stage is None or mine in n)]
        if not models:
            hint = (" It holds a `latest` file: pass the tag directory it names, or use "
                    "zeroshard.checkpoint.sources.find_checkpoint()." if "latest" in names else "")
            raise FileNotFoundError(f"{ckpt_dir}: not a DeepSpeed checkpoint directory: no *_model_states.pt "
                                    f"file.{hint}")
        other = [n for n in names if n.startswith(("expp_rank_", "layer_"))]
        other += [n for n in models + optims if not re.search(r"mp_rank_00_", n)]
        if other and self._stage is None:
            raise ValueError(f"{ckpt_dir}: {', '.join(other)}: mixture-of-experts, pipeline or tensor-parallel "
                             "checkpoints are not supported here; expected data parallelism only (mp_rank_00). "
                             "A pipeline's (layer_* files) is read by checkpoint_import.deepspeed_pipe")
        if not optims:
            which = "" if self._stage is None else f" for pipeline stage {self._stage} (*{mine}*)"
            raise FileNotFoundError(f"{ckpt_dir}: no *_optim_states.pt files{which}; a ZeRO checkpoint has one per "
                                    "data-parallel rank (a stage-0 checkpoint is not supported)")
        prefixes = {OPTIM_FILE_RE.match(n).group(1) or "" for n in optims}
        if len(prefixes) > 1:
            raise ValueError(f"{ckpt_dir}: both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files; "
                             "expected one kind (files of two runs in one tag directory?)")
        prefix = prefixes.pop()

        def optim_name(rank):
            return f"{prefix}zero_pp_rank_{rank}_{self._mp}_optim_states.pt"
        first = os.path.join(ckpt_dir, optim_name(0))
        if not os.path.isfile(first):
            raise FileNotFoundError(f"{first}: missing; found {', '.join(optims)}")
        optim0 = self._checked_optim(load_file(first), first)
        counts = optim0["partition_count"]
        world = max(counts) if isinstance(counts, (list, tuple)) else counts
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"{first}: partition_count is {counts!r}; expected the data-parallel world size")
        if isinstance(counts, (list, tuple)) and any(c != world for c in counts):
            raise ValueError(f"{first}: partition_count {counts} differs between param groups (expert "
                             "parallelism); not supported")
        stage3 = any(MODEL_FILE_RE.match(n).group(1) is not None for n in models)
        want_models = ([f"zero_pp_rank_{r}_{self._mp}_model_states.pt" for r in range(world)] if stage3
                       else [f"{self._mp}_model_states.pt"])
        want_optims = [optim_name(r) for r in range(world)]
        missing = [n for n in want_models + want_optims if n not in names]
        if missing:
            raise FileNotFoundError(f"{ckpt_dir}: missing {', '.join(missing)}: the checkpoint was saved at world "
                                    f"size {world} (partition_count in {os.path.basename(first)}) and has one "
                                    "file per rank")
        extra = sorted(set(models + optims) - set(want_models + want_optims))
        if extra:
            raise ValueError(f"{ckpt_dir}: {', '.join(extra)}: not part of a world-size-{world} checkpoint "
                             "(left over from another save?)")
        self.world_size = world
        self._per_rank_models = stage3
        return ([os.path.join(ckpt_dir, n) for n in want_models], [os.path.join(ckpt_dir, n) for n in want_optims],
                optim0)

    def _checked_model(self, state, path):
        if not isinstance(state, dict) or "module" not in state or "buffer_names" not in state:
            raise ValueError(f"{path}: not a DeepSpeed model states file: expected a dict with 'module' and "
                             "'buffer_names'")
        if state["module"] is None and self._stage is None:
            raise ValueError(f"{path}: holds no module: a pipeline stage's file, whose weights are in layer files; "
                             "open the directory with checkpoint_import.deepspeed_pipe (load_checkpoint does)")
        if not isinstance(state.get("param_shapes"), list):
            raise ValueError(f"{path}: has no param_shapes: not saved under ZeRO (stage 0 is not supported)")
        return state

    @staticmethod
    def _checked_optim(state, path):
        inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(inner, dict) or "partition_count" not in inner:
            raise ValueError(f"{path}: not a DeepSpeed ZeRO optimizer states file: expected "
                             "optimizer_state_dict with partition_count")
        return inner

    # ---- layout ------------------------------------------------------------------------------------
    def _read_layout(self):
        model0, optim0 = self._model[0], self._optim[0]
        config = model0.get("ds_config")
        config_stage = (config.get("zero_optimization") or {}).get("stage") if isinstance(config, dict) else None
        if "zero_stage" in optim0:
            self.zero_stage = int(optim0["zero_stage"])
            self._padded_master = False
        elif "single_partition_of_fp32_groups" in optim0:
            # DeepSpeed's BF16_Optimizer (stage 0/1 with bf16 weights and fp32 gradient accumulation)
            # saves no stage and keeps the alignment padding in its fp32 partitions.
            self.zero_stage = int(config_stage) if config_stage is not None else 1
            self._padded_master = True
        else:
            raise ValueError(f"{self._optim_paths[0]}: neither zero_stage nor single_partition_of_fp32_groups; "
                             "not a ZeRO optimizer layout this reader knows")
        if self.zero_stage not in (0, 1, 2, 3) or (self.zero_stage == 3) != self._per_rank_models:
            raise ValueError(f"{self._optim_paths[0]}: zero_stage {self.zero_stage} does not match the model "
                             "states files (one per rank under stage 3, one in all under stages 0-2)")
        flat_key = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
        self._flat_key = flat_key
        for rank, optim in enumerate(self._optim):
            if not isinstance(optim.get(flat_key), list):
                raise ValueError(f"{self._optim_paths[rank]}: no {flat_key} list")
        param_shapes = model0["param_shapes"]
        if len(param_shapes) != len(optim0[flat_key]):
            raise ValueError(f"{self.path}: {len(param_shapes)} param_shapes groups but {len(optim0[flat_key])} "
                             f"{flat_key}; the files do not belong together")
        self._base = self._base_optimizer_state(optim0)
        # flat group k <-> torch optimizer state key: torch numbers params group by group.
        if isinstance(self._base, dict):
            self._state_keys = [i for g in self._base.get("param_groups", []) for i in g["params"]]
        else:
            self._state_keys = list(range(len(param_shapes)))
        if len(self._state_keys) != len(param_shapes):
            raise ValueError(f"{self._optim_paths[0]}: {len(self._state_keys)} optimizer params for "
                             f"{len(param_shapes)} flat groups")
        self._slots = {}
        for group, shapes in enumerate(param_shapes):
            if self.zero_stage == 3:
                self._place_stage3(group, shapes)
            else:
                self._place_flat(group, shapes)

        self._shared = dict(model0.get("shared_params") or {})
        module = model0["module"] or {}  # a pipeline stage's: its layer files hold the weights
        buffers = set(model0["buffer_names"])
        if model0.get("frozen_param_shapes") is not None:  # stages 2/3
            self._frozen = {n: torch.Size(s) for n, s in model0["frozen_param_shapes"].items()}
        elif self.zero_stage == 3:  # saved with exclude_frozen_parameters=True
            self._frozen = {}
        else:  # stage 1 records frozen parameters only in the module state_dict
            self._frozen = {n: t.shape for n, t in module.items()
                            if n not in buffers and n not in self._slots and n not in self._shared
                            and not n.endswith("_extra_state")}
        owned = list(self._slots) + list(self._frozen)
        self.param_names = [n for n in module if n in owned] + [n for n in owned if n not in module]
        self.frozen_names = set(self._frozen)
        self.buffer_names = [n for n in model0["buffer_names"] if n in module]
        self.shared_params = dict(self._shared)  # tied name -> the parameter it shares
        trainable = next(iter(self._slots), None)
        module_dtype = module[trainable].dtype if trainable in module else _config_dtype(config)
        if module_dtype not in PRECISION_OF:
            raise ValueError(f"{self.path}: parameter {trainable} has dtype {module_dtype}; expected float32, "
                             "bfloat16 or float16")
        self._module_dtype = module_dtype
        self.dtype = PRECISION_OF[module_dtype]
        try:
            self.optimizer_state_names = _state_names(self._rank_state(0, 0))
            self.state_problem = self._check_states(len(param_shapes))
        except ValueError as error:  # a file without a torch state_dict: the weights and masters are whole
            self.optimizer_state_names, self.state_problem = [], f"the optimizer state is damaged: {error}"

    def _check_states(self, groups):
        """What is wrong with the optimizer state, else None: every rank's every group must hold the
        states rank 0's first group holds, each as long as its partition, so that a load asking for
        it is refused before writing, not part-way. Only such a load needs it (sources.py reports it
        as the state's "unread" reason; tensor() refuses optim/ keys). DeepSpeed's Muon, whose groups
        say so (use_muon), keeps other states, laid out otherwise: named as such, not as damage."""
        if self._saved_by_muon():
            return ("it was saved by DeepSpeed's Muon optimizer, whose state (Muon's momentum for the matrices, "
                    "Adam's moments for the rest) no zeroshard optimizer keeps")
        for group in range(groups):
            for rank in range(self.world_size):
                have = _state_names(self._rank_state(rank, group))
                if sorted(have) != sorted(self.optimizer_state_names):
                    return (f"the optimizer state is damaged: {self._optim_paths[rank]}: flat group {group} holds "
                            f"{have or 'no state'} where {os.path.basename(self._optim_paths[0])}'s flat group 0 "
                            f"holds {self.optimizer_state_names}")
                size = self._lean(rank, group, None).numel()
                for name in have:
                    held = self._lean(rank, group, name).numel()
                    if held != size:
                        return (f"the optimizer state is damaged: {self._optim_paths[rank]}: flat group {group}'s "
                                f"{name} holds {held} elements, expected its partition's {size}")
        return None

    def _saved_by_muon(self):
        """DeepSpeed's Muon marks its param groups use_muon; an elastic checkpoint saves no groups,
        but its config names the optimizer (DeepSpeed matches the name in any case)."""
        base, config = self._base, self._model[0].get("ds_config")
        if isinstance(base, dict) and any("use_muon" in g for g in base.get("param_groups", [])):
            return True
        optimizer = config.get("optimizer") if isinstance(config, dict) else None
        return isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() == "muon"

    def param_groups_of(self):
        """{parameter name: index of the optimizer param group that holds it} (tied names included)."""
        if self._groups_of is None:
            groups = self._optimizer_section()["param_groups"]
            self._groups_of = {n: g for g, group in enumerate(groups) for n in group["params"]}
            self._groups_of.update((tied, self._groups_of[name]) for tied, name in self._shared.items()
                                   if name in self._groups_of)
        return self._groups_of

    def _base_optimizer_state(self, optim):
        if self.zero_stage == 3:
            return optim.get("optimizer_state_dict")
        return optim.get("base_optimizer_state")  # a list per group when saved as elastic_checkpoint

    def _place_flat(self, group, shapes):
        """Stages 1/2: a group's parameters lie back to back (plus DeepSpeed's per-parameter alignment
        paddings, if any) in the concatenation of the ranks' partitions, once each rank's trailing
        group padding is cut off."""
        paddings = (self._optim[0].get("param_alignment_paddings") or [None] * (group + 1))[group]
        paddings = paddings or [0] * len(shapes)
        if len(paddings) != len(shapes):
            raise ValueError(f"{self._optim_paths[0]}: param_alignment_paddings[{group}] has {len(paddings)} "
                             f"entries for {len(shapes)} parameters")
        offset = 0
        for (name, shape), padding in zip(shapes.items(), paddings):
            self._slots[name] = _Slot(group, offset, shape)
            offset += self._slots[name].numel + padding
        have = sum(self._lean(rank, group, None).numel() for rank in range(self.world_size))
        if have != offset:
            raise ValueError(f"{self.path}: flat group {group}: the ranks' partitions hold {have} elements but "
                             f"param_shapes and paddings describe {offset}; not a layout this reader knows")

    def _place_stage3(self, group, shapes):
        """Stage 3: each rank's flat group is, per parameter in order, its ceil(numel / world) slice;
        the last rank's slice is zero-padded."""
        offset = 0
        for name, shape in shapes.items():
            self._slots[name] = _Slot(group, offset, shape)
            offset += -(-self._slots[name].numel // self.world_size)
        for rank in range(self.world_size):
            have = self._lean(rank, group, None).numel()
            if have != offset:
                raise ValueError(f"{self._optim_paths[rank]}: fp32_flat_groups[{group}] holds {have} elements; "
                                 f"param_shapes describe {offset} per rank")

    def _rank_state(self, rank, group):
        base = self._base_optimizer_state(self._optim[rank])
        if isinstance(base, list):
            return base[group]
        if not isinstance(base, dict) or "state" not in base:
            raise ValueError(f"{self._optim_paths[rank]}: no torch optimizer state_dict inside")
        return base["state"].get(self._state_keys[group], {})

    def _lean(self, rank, group, state_name):
        """Rank's piece of flat group `group` (fp32 master when state_name is None), without the padding
        DeepSpeed appends to make the group divide evenly among ranks."""
        optim = self._optim[rank]
        if state_name is None:
            tensor = optim[self._flat_key][group]
            padded = self._padded_master
        else:
            tensor = self._rank_state(rank, group).get(state_name)
            if not torch.is_tensor(tensor):
                raise ValueError(f"{self._optim_paths[rank]}: no optimizer state {state_name!r} for flat group "
                                 f"{group}")
            padded = not isinstance(self._base_optimizer_state(optim), list)
        if self.zero_stage < 3 and padded:
            tensor = tensor[:tensor.numel() - optim["group_paddings"][group]]
        return tensor.detach()

    # ---- tensors -----------------------------------------------------------------------------------
    def shape(self, name):
        name = self._shared.get(name, name)
        if name in self._slots:
            return self._slots[name].shape
        if name in self._frozen:
            return self._frozen[name]
        raise KeyError(self._unknown(name))

    def tensor(self, key):
        """Full CPU tensor for "param/<n>" (module dtype), "master/<n>" (fp32), "optim/<state>/<n>" or
        "buffer/<n>"."""
        kind, _, rest = key.partition("/")
        if kind == "buffer":
            if rest not in self.buffer_names:
                raise KeyError(f"{key!r}: no buffer {rest!r} in {self.path}; buffers: {self.buffer_names}")
            return self._model[0]["module"][rest].detach().clone()
        if kind == "optim":
            state, _, name = rest.partition("/")
            if self.state_problem:
                raise ValueError(f"{key!r}: {self.path}: {self.state_problem}")
            if state not in self.optimizer_state_names:
                raise KeyError(f"{key!r}: no optimizer state {state!r}; expected one of "
                               f"{self.optimizer_state_names}")
        elif kind in ("param", "master"):
            state, name = None, rest
        else:
            raise KeyError(f"{key!r}: expected param/<name>, master/<name>, optim/<state>/<name> or "
                           "buffer/<name>")
        name = self._shared.get(name, name)
        if name in self._frozen and kind == "param":
            return self._frozen_param(name)
        if name in self._frozen:
            raise KeyError(f"{key!r}: {name} is frozen: it has no master copy or optimizer state; use "
                           f"'param/{name}'")
        if name not in self._slots:
            raise KeyError(self._unknown(name))
        if kind == "param" and self.zero_stage < 3:
            return self._module_tensor(name, self._slots[name].shape)
        full = self._gather(self._slots[name], state)
        # ZeRO-3 saves no 16-bit copy of trainable weights; DeepSpeed rebuilds it from the fp32 master.
        return full.to(self._module_dtype) if kind == "param" else full

    def _gather(self, slot, state_name):
        pieces = [self._lean(rank, slot.group, state_name) for rank in range(self.world_size)]
        out = torch.empty(slot.numel, dtype=pieces[0].dtype)
        if self.zero_stage == 3:
            part = -(-slot.numel // self.world_size)
            for rank, piece in enumerate(pieces):
                lo = rank * part
                count = min(part, slot.numel - lo)
                if count > 0:
                    out[lo:lo + count].copy_(piece[slot.offset:slot.offset + count])
        else:
            begin = 0  # where this rank's piece starts in the group's concatenation
            for piece in pieces:
                lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, begin + piece.numel())
                if lo < hi:
                    out[lo - slot.offset:hi - slot.offset].copy_(piece[lo - begin:hi - begin])
                begin += piece.numel()
        return out.view(slot.shape)

    def _frozen_param(self, name):
        shape = self._frozen[name]
        if self.zero_stage < 3:
            return self._module_tensor(name, shape)
        fragments = []
        for rank, model in enumerate(self._model):
            fragment = (model.get("frozen_param_fragments") or {}).get(name)
            if fragment is None:
                raise ValueError(f"{self._model_path(rank)}: no frozen_param_fragments entry for {name}")
            fragments.append(fragment.detach().reshape(-1))
        return torch.cat(fragments)[:math.prod(shape)].view(shape).clone()

    def _module_tensor(self, name, shape):
        tensor = self._model[0]["module"].get(name)
        if tensor is None or tensor.shape != shape:
            got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
            raise ValueError(f"{self._model_path(0)}: module[{name!r}] holds {got}; expected shape {tuple(shape)}")
        return tensor.detach().clone()

    def _model_path(self, rank):
        name = (f"zero_pp_rank_{rank}_{self._mp}_model_states.pt" if self._per_rank_models
                else f"{self._mp}_model_states.pt")
        return os.path.join(self.path, name)

    def _unknown(self, name):
        return f"{name!r}: no such parameter in {self.path}; it has {', '.join(self.param_names)}"

    # ---- sections ----------------------------------------------------------------------------------
    def sections(self):
        """Plain JSON values (client_state may also hold CPU tensors, as saved)."""
        model0, optim0 = self._model[0], self._optim[0]
        training = {k: int(model0[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                    if model0.get(k) is not None}
        return {
            "training_state": training,  # DeepSpeed does not save micro_steps
            "loss_scaler": self._loss_scaler(optim0),
            "lr_scheduler": plain_value(model0.get("lr_scheduler")),
            "client_state": {k: plain_value(v, keep_tensors=True) for k, v in model0.items() if k not in ENGINE_KEYS},
            "optimizer": self._optimizer_section(),
            "deepspeed": {"version": plain_value(model0.get("ds_version")),
                          "config": plain_value(model0.get("ds_config")), "zero_stage": self.zero_stage,
                          "world_size": self.world_size, "dtype": self.dtype},
        }

    @staticmethod
    def _loss_scaler(optim):
        scaler = optim.get("loss_scaler")
        if scaler is None:
            return {}  # BF16_Optimizer: bf16 needs no loss scaling and saves no scaler
        fields = plain_value(vars(scaler))
        section = {"scale": fields.pop("cur_scale", None), "dynamic": bool(optim.get("dynamic_loss_scale"))}
        section.update((k, v) for k, v in fields.items() if k != "dynamic")
        return section

    def _optimizer_section(self):
        base = self._base
        names = [list(shapes) for shapes in self._model[0]["param_shapes"]]
        if isinstance(base, list):  # elastic_checkpoint: per-group state, hyper-parameters not saved
            groups = [{"params": n} for n in names]
            step = self._optim[0].get("base_optimizer_state_step")
        elif isinstance(base, dict):
            position = {key: k for k, key in enumerate(self._state_keys)}
            groups = []
            for group in base.get("param_groups", []):
                plain = {k: plain_value(v) for k, v in group.items() if k != "params" and not _is_big_tensor(v)}
                plain["params"] = [n for key in group["params"] for n in names[position[key]]]
                groups.append(plain)
            step = next((s["step"] for s in base.get("state", {}).values() if "step" in s), None)
        else:  # no optimizer state_dict (state_problem says so)
            groups, step = [], None
        if step is None and groups:
            step = groups[0].get("step")
        return {"type": _optimizer_type(groups), "step": None if step is None else int(plain_value(step)),
                "param_groups": groups}


def _state_names(state):
    """The per-element states of one flat group's optimizer state (exp_avg, exp_avg_sq; not step)."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]


def _config_dtype(config):
    """The weights' dtype a DeepSpeed config sets (where no saved module tensor tells)."""
    def enabled(*keys):
        return any(isinstance(config, dict) and (config.get(k) or {}).get("enabled") is True for k in keys)
    return torch.bfloat16 if enabled("bf16", "bfloat16") else torch.float16 if enabled("fp16") else torch.float32


def _is_big_tensor(value):
    return torch.is_tensor(value) and value.numel() != 1


def _optimizer_type(groups):
    """torch's class name, inferred from the hyper-parameters torch puts in a param group ("Muon" for
    DeepSpeed's, whose groups carry use_muon); None when they do not tell (DeepSpeed does not save
    the class)."""
    keys = set(groups[0]) if groups else set()
    if any("use_muon" in g for g in groups):  # DeepSpeed's Muon, its Muon and Adam groups
        return "Muon"
    if {"betas", "eps", "amsgrad", "decoupled_weight_decay"} <= keys:
        return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    if {"momentum", "dampening", "nesterov"} <= keys:
        return "SGD"
    return None


def plain_value(value, keep_tensors=False):
    """JSON-able copy: tuples become lists, one-element tensors numbers, stand-ins their attributes."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (int, float)):
        return value
    if torch.is_tensor(value):
        if keep_tensors:
            return value.detach().clone()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, dict):
        return {str(k): plain_value(v, keep_tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset, torch.Size)):
        return [plain_value(v, keep_tensors) for v in value]
    if hasattr(value, "__dict__"):
        return plain_value(vars(value), keep_tensors)
    return repr(value)
