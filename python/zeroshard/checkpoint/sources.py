"""Where a load reads from: a zeroshard checkpoint directory (manifest + safetensors, read by range
in C++), a DeepSpeed ZeRO checkpoint directory (its .pt files, read with weights_only and an
allow-list, checkpoint_import/deepspeed.py) or a DeepSpeed pipeline one (its layer files,
checkpoint_import/deepspeed_pipe.py). All three answer has / shape / read(name, begin, out) for
the names of layout.py and give the sections a load needs in zeroshard's form."""
import abc
import os

import torch

from zeroshard import _C
from zeroshard.checkpoint.layout import buffer_key, tensor_name
from zeroshard.checkpoint_import.deepspeed import DeepSpeedCheckpoint, is_deepspeed_checkpoint
from zeroshard.checkpoint_import.deepspeed_pipe import (DeepSpeedPipelineCheckpoint,
                                                     is_deepspeed_pipeline_checkpoint)


# safetensors' dtype names (what manifest.json records) -> torch dtypes: runtime/checkpoint's table.
TORCH_DTYPES = dict(_C.checkpoint.safetensors_dtypes())


def tags_in(load_dir):
    return sorted(e for e in os.listdir(load_dir)
                  if os.path.isdir(os.path.join(load_dir, e)) and not e.startswith("."))


def find_checkpoint(load_dir, tag=None):
    """(directory, tag) of checkpoint `tag` in `load_dir`, the tag read from `load_dir/latest` when
    None (zeroshard and DeepSpeed both write it); (None, None) when there is no `latest`. A missing
    load_dir or tag is a FileNotFoundError that lists the tags there."""
    load_dir = os.fspath(load_dir)
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"{load_dir}: no such checkpoint directory")
    named_by = ""
    if tag is None:
        tag = _C.checkpoint.read_latest(load_dir)
        if tag is None:
            return None, None
        named_by = f", named by {os.path.join(load_dir, 'latest')}"
    path = _C.checkpoint.find_checkpoint_dir(load_dir, str(tag))
    if path is None:
        raise FileNotFoundError(f"{os.path.join(load_dir, str(tag))}: no such checkpoint (tag {str(tag)!r}"
                                f"{named_by}); checkpoints there: {', '.join(tags_in(load_dir)) or 'none'}")
    return path, str(tag)


class NativeSource:
    kind = "zeroshard"
    masters_with_optimizer = False  # load.py's _source_of: its masters load with the weights

    def __init__(self, path, verify_before_writing=True):
        self.path = path
        self.reader = _C.checkpoint.CheckpointReader(path, verify_before_writing)
        manifest = self.reader.manifest
        self._shapes = {name: shape for name, shape, _ in manifest.tensors()}
        self._dtypes = {name: dtype for name, _, dtype in manifest.tensors()}
        self._manifest = manifest

    def has(self, name):
        return name in self._shapes

    def open_all(self):
        self.reader.open_all()

    def shape(self, name):
        return self._shapes[name]

    def read(self, name, begin, out):
        self.reader.read(name, begin, out)

    def dtype(self, name):
        return TORCH_DTYPES[self._dtypes[name]]

    def section(self, name):
        return self._manifest.section(name) if self._manifest.has_section(name) else None

    def read_whole(self, name):
        """A whole stored tensor in its own dtype, on the CPU (client_state's tensors)."""
        out = torch.empty(self._shapes[name], dtype=TORCH_DTYPES[self._dtypes[name]])
        self.reader.read(name, 0, out)
        return out


class _WholeTensorSource(abc.ABC):
    """What the DeepSpeed sources share: a tensor is rebuilt whole by _tensor(key) (DeepSpeed's
    files are per rank or per layer, not per range), the last one kept for the ranges that follow."""
    masters_with_optimizer = True  # as DeepSpeed: without the optimizer state, masters from the weights
    _cached = (None, None)

    @abc.abstractmethod
    def _tensor(self, key):
        """The whole tensor stored under `key`, rebuilt from the source's own files."""

    def _full(self, key):
        if self._cached[0] != key:
            self._cached = (key, self._tensor(key))
        return self._cached[1]

    def open_all(self):  # every file was read whole when opened
        pass

    def shape(self, key):
        return list(self._full(key).shape)

    def dtype(self, key):
        return self._full(key).dtype

    def read(self, key, begin, out):
        flat = self._full(key).reshape(-1)
        out.view(-1).copy_(flat[begin:begin + out.numel()])

    def read_whole(self, key):  # DeepSpeed's client_state holds its tensors already
        raise KeyError(key)


class DeepSpeedSource(_WholeTensorSource):
    """A DeepSpeed ZeRO checkpoint in zeroshard's terms."""
    kind = "DeepSpeed"

    def __init__(self, path):
        self.path = path
        self.ds = DeepSpeedCheckpoint(path)
        self._sections = self.ds.sections()
        self._names = set()
        for n in self.ds.param_names:
            self._names.add(tensor_name("param", n))
            if n not in self.ds.frozen_names:
                self._names.add(tensor_name("master", n))
                self._names.update(tensor_name(s, n) for s in self.ds.optimizer_state_names)
        self._names.update(buffer_key(n) for n in getattr(self.ds, "buffer_names", []))

    def has(self, name):
        return name in self._names

    def _tensor(self, key):
        return self.ds.tensor(key)

    def section(self, name):
        s = self._sections
        ds = s["deepspeed"]
        if name == "layout":
            group = self.ds.param_groups_of()
            params = [{"name": n, "shape": list(self.ds.shape(n)), "trainable": n not in self.ds.frozen_names,
                       "group": group.get(n)} for n in self.ds.param_names]
            return {"world_size": ds["world_size"], "zero_stage": ds["zero_stage"], "dtype": ds["dtype"],
                    "params": params, "buffers": list(getattr(self.ds, "buffer_names", [])),
                    "aliases": dict(self.ds.shared_params),
                    "frozen_excluded": False,
                    "optimizer": {"type": s["optimizer"]["type"],
                                  "state_names": list(self.ds.optimizer_state_names),
                                  **({"unread": f"{self.path}: {self.ds.state_problem}"}
                                     if self.ds.state_problem else {})}}
        if name == "training_state":
            return _training_state(s)
        if name == "param_groups":
            return _param_groups(s)
        if name in ("lr_scheduler", "client_state"):
            return s[name]
        return None


def _param_groups(sections):
    return [{k: v for k, v in g.items() if k != "params"} for g in sections["optimizer"]["param_groups"]]


def _training_state(sections):
    """A DeepSpeed checkpoint's sections (deepspeed.py's and deepspeed_pipe.py's sections()) as
    TrainingState's."""
    t, opt = sections["training_state"], sections["optimizer"]
    step = opt.get("step") or 0
    return {"global_steps": t.get("global_steps", 0), "micro_steps": t.get("micro_steps", 0),
            "global_samples": t.get("global_samples", 0), "skipped_steps": t.get("skipped_steps", 0),
            "group_steps": [step] * max(1, len(opt["param_groups"])),
            "loss_scaler": _loss_scaler(sections.get("loss_scaler") or {})}


def _loss_scaler(scaler):
    """DeepSpeed's scaler fields in TrainingState's form: its iterations since the last overflow
    (cur_iter - last_overflow_iter - 1; last_overflow_iter 0 is an overflow at the first iteration,
    -1 none yet)."""
    last = scaler.get("last_overflow_iter")
    last = -1 if last is None else int(last)
    dynamic = bool(scaler.get("dynamic"))
    return {"scale": float(scaler.get("scale") or 1.0),
            "steps_since_overflow": int(scaler.get("cur_iter") or 0) - last - 1 if dynamic else 0,
            "hysteresis_left": int(scaler.get("cur_hysteresis") or 0)}


class DeepSpeedPipelineSource(_WholeTensorSource):
    """A DeepSpeed PipelineEngine checkpoint in zeroshard's terms, named as the same layers are
    without a pipeline ("3.fc1.weight"; a tie by its first layer): a pipeline run reads its ties
    through checkpoint/pipeline.py's renaming, as from a checkpoint saved without one. The run tells
    what is tied (load.py calls bind_ties with its whole tied modules or shared tensors, and a
    pipeline's tie keys): the files do not. Only the layers are saved, so what a pipeline holds
    outside them (a loss_fn module's tensors) is left as built. Its fp32 masters and optimizer
    state are read under ZeRO-1 (deepspeed_pipe_optim.py); the masters only with the optimizer
    state, as DeepSpeed does (a load without it makes them from the weights)."""
    kind = "DeepSpeed pipeline"

    def __init__(self, path):
        self.path = path
        self.ds = DeepSpeedPipelineCheckpoint(path)
        self._saved = self.ds.sections()

    def bind_ties(self, ties, keys):
        """ties, keys: the run's (checkpoint/pipeline.py's tie_groups and tie_keys;
        DeepSpeedPipelineCheckpoint.share_ties)."""
        self.ds.share_ties(ties, keys)
        self._saved = self.ds.sections()  # the optimizer's sections once its names are known
        self._cached = (None, None)  # names may now stand for other tensors

    def _tensor(self, key):
        """A stored tensor answers as a parameter and as a buffer (see DeepSpeedPipelineCheckpoint)."""
        kind, _, name = key.partition("/")
        return self.ds.tensor(name) if kind in ("param", "buffer") else self.ds.optimizer.tensor(key)

    def has(self, key):
        kind, _, name = key.partition("/")
        return self.ds.has(name) if kind in ("param", "buffer") else self.ds.optimizer.has(key)

    def section(self, name):
        ds, saved, optimizer = self.ds, self._saved, self.ds.optimizer
        if name == "layout":
            # Every tensor as a parameter (see _full); which were frozen is not saved.
            params = [{"name": n, "shape": list(ds.tensor(n).shape), "trainable": True, "group": None}
                      for n in ds.names]
            saved_optimizer = {"type": saved["optimizer"]["type"], "state_names": optimizer.state_names}
            if optimizer.unread or not optimizer.saved:
                saved_optimizer["unread"] = optimizer.unread or (f"{self.path} is a DeepSpeed pipeline checkpoint "
                                                                 f"(ZeRO stage {ds.zero_stage}), which holds no "
                                                                 "optimizer state")
            return {"world_size": ds.num_stages * ds.data_parallel_size, "zero_stage": ds.zero_stage,
                    "dtype": ds.dtype, "num_stages": ds.num_stages, "params": params, "buffers": [],
                    "aliases": {}, "frozen_excluded": False, "layers_only": True, "optimizer": saved_optimizer}
        if name == "training_state":
            return _training_state(saved)
        if name == "param_groups":
            return _param_groups(saved) if optimizer.state_names else None
        if name in ("lr_scheduler", "client_state"):
            return saved[name]
        return None  # no pipeline section: the names are the layers' (see the class's docstring)


def is_checkpoint(path):
    return (os.path.exists(os.path.join(path, _C.checkpoint.MANIFEST)) or is_deepspeed_checkpoint(path)
            or is_deepspeed_pipeline_checkpoint(path))


def open_source(path, verify_before_writing=True):
    """The checkpoint in directory `path`: zeroshard's (manifest.json) or DeepSpeed's (*.pt).
    `verify_before_writing`: see CheckpointReader (false only where the destination is scratch)."""
    if os.path.exists(os.path.join(path, _C.checkpoint.MANIFEST)):
        return NativeSource(path, verify_before_writing)
    if is_deepspeed_pipeline_checkpoint(path):  # before the next: it has mp_rank_00_model_states.pt too
        return DeepSpeedPipelineSource(path)
    if is_deepspeed_checkpoint(path):
        return DeepSpeedSource(path)
    listing = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
    raise FileNotFoundError(f"load_checkpoint: {path} is neither a zeroshard checkpoint (no "
                            f"{_C.checkpoint.MANIFEST}) nor a DeepSpeed one (no *_model_states.pt); "
                            f"it holds {listing}")
