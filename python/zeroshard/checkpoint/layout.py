"""What a checkpoint holds and under which names: the run as the checkpoint code sees it (RunView),
which rank writes what (Placement), this rank's pieces to write, the "layout" section, and
client_state as JSON plus tensors."""
import math
from dataclasses import dataclass, field

import torch

from zeroshard import _C
from zeroshard.checkpoint.groups import EVERY_GROUP
from zeroshard.dtypes import PRECISION_OF


def tensor_name(kind: str, name: str) -> str:
    """The checkpoint's name for one parameter's `kind` ("param", "master" or a state name)."""
    if kind in ("param", "master"):
        return f"{kind}/{name}"
    return f"optim/{kind}/{name}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def renamed_key(key: str, rename) -> str:
    """`key` with the parameter or buffer name in it passed through rename(name); client_state's
    keys as they are."""
    head, _, rest = key.partition("/")
    if head == "optim":
        state, _, rest = rest.partition("/")
        head = f"optim/{state}"
    elif head not in ("param", "master", "buffer"):
        return key
    return f"{head}/{rename(rest)}"


@dataclass(frozen=True)
class Placement:
    """Which ranks write what. A data-parallel engine: every rank holds every parameter, the
    agreements run over the world, and rank 0 describes the model. A pipeline engine
    (checkpoint/pipeline.py): each stage's data-parallel ranks hold that stage's parameters."""
    comm: object  # the agreements of a save or load: over every rank that writes or reads
    part_rank: int  # this rank's index among the ranks that hold the same parameters whole ...
    part_world: int  # ... and their number: whole ("replicated") pieces are split among them
    describes: bool  # writes its parameters' layout entries and its buffers (one rank per stage)
    not_written: frozenset = frozenset()  # held here, written by another stage (later tie owners)
    names_split: bool = False  # the model's names are spread over ranks (a load checks them jointly)
    pipeline: dict = None  # the "pipeline" section (checkpoint/pipeline.py), None for no pipeline

    @classmethod
    def data_parallel(cls, engine):
        return cls(comm=engine._comm, part_rank=engine.global_rank, part_world=engine.world_size,
                   describes=engine.global_rank == 0)


@dataclass
class RunView:
    """The engine as checkpoints see it. `names[i]` / `shapes[i]`: the core's parameter i (trainable
    group by group, then stage 3's frozen ones); `loose`: parameters the core does not hold (frozen
    ones below stage 3, trainable ones in no optimizer group), whole on every rank."""
    device: torch.device
    rank: int
    world: int
    core: object
    module: torch.nn.Module
    dtype: torch.dtype
    names: list
    shapes: list
    trainable: list
    groups: list  # the group of each core parameter (its index in optimizer.param_groups), None for frozen
    loose: list = field(default_factory=list)  # (name, Parameter)
    buffers: list = field(default_factory=list)  # (name, tensor), persistent ones
    aliases: dict = field(default_factory=dict)  # tied name -> the name it shares
    placement: Placement = None
    groups_alike: bool = True  # every rank numbers the param groups alike (optimizer.numbered_alike)

    @property
    def comm(self):
        return self.placement.comm

    @property
    def stage(self) -> int:
        return self.core.strategy.stage

    @property
    def dtype_name(self) -> str:
        return PRECISION_OF[self.dtype]

    @classmethod
    def of(cls, engine):
        core = engine._core
        held = engine._gathered if core.strategy.partitions_params else engine._params
        names = {id(p): n for n, p in engine.module.named_parameters()}
        group_of = {}
        for g, group in enumerate(engine.optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = g
        shapes = [list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape) for p in held]
        held_ids = {id(p) for p in held}
        loose = [(n, p) for n, p in engine.module.named_parameters() if id(p) not in held_ids]
        persistent = set(engine.module.state_dict().keys())
        buffers = [(n, b) for n, b in engine.module.named_buffers() if n in persistent]
        aliases = {}
        for n, p in engine.module.named_parameters(remove_duplicate=False):
            if names.get(id(p), n) != n:
                aliases[n] = names[id(p)]
        # A pipeline engine says how its stages divide the writing (pipe/engine.py's hook).
        hook = getattr(type(engine), "_checkpoint_placement", None)
        placement = hook(engine) if hook is not None else Placement.data_parallel(engine)
        return cls(device=engine.device, rank=engine.global_rank,
                   world=engine.world_size, core=core, module=engine.module, dtype=engine.dtype,
                   names=[names[id(p)] for p in held], shapes=shapes,
                   trainable=[p.requires_grad for p in held], groups=[group_of.get(id(p)) for p in held],
                   loose=loose, buffers=buffers, aliases=aliases, placement=placement,
                   groups_alike=engine.optimizer.numbered_alike)


def my_part(numel: int, rank: int, world: int):
    """Rank `rank`'s part [begin, end) of a tensor every rank holds whole, so all ranks write."""
    chunk = math.ceil(numel / world) if numel else 0
    begin = min(numel, rank * chunk)
    return begin, min(numel, begin + chunk)


def rank_items(run: RunView, exclude_frozen: bool):
    """(name, global shape, first element, 1-D values) for every piece this rank writes."""
    items = []
    where = run.placement

    def add(name, shape, begin, flat, replicated):
        if replicated:
            lo, hi = my_part(flat.numel(), where.part_rank, where.part_world)
            begin, flat = begin + lo, flat[lo:hi]
        if flat.numel():
            items.append((name, list(shape), begin, flat))

    # The caller ends the entries (run.core.end_entries) once it has written them: parameter
    # chunks on NVMe leave host memory then, and these views would read zeros after.
    entries = run.core.shard_entries(False)
    for kind, index, begin, values, replicated in entries:
        if (exclude_frozen and not run.trainable[index]) or run.names[index] in where.not_written:
            continue
        add(tensor_name(kind, run.names[index]), run.shapes[index], begin, values, replicated)
    for name, p in run.loose:
        if (exclude_frozen and not p.requires_grad) or name in where.not_written:
            continue
        add(tensor_name("param", name), p.shape, 0, p.detach().reshape(-1), True)
    # Buffers may differ across ranks (BatchNorm without SyncBN): one rank's, as DeepSpeed (rank 0's;
    # in a pipeline, each stage's first data-parallel rank's).
    if where.describes:
        for name, b in run.buffers:
            if name not in where.not_written:
                add(buffer_key(name), b.shape, 0, b.detach().reshape(-1), False)
    return items


def layout_entries(run: RunView) -> dict:
    """The parameters, buffers and aliases of this rank's module, as the layout lists them."""
    params = [{"name": n, "shape": s, "trainable": t, "group": g}
              for n, s, t, g in zip(run.names, run.shapes, run.trainable, run.groups)]
    params += [{"name": n, "shape": list(p.shape), "trainable": p.requires_grad, "group": None}
               for n, p in run.loose]
    order = {n: i for i, (n, _) in enumerate(run.module.named_parameters())}
    params.sort(key=lambda p: order[p["name"]])  # the module's order, as its state_dict has it
    return {"params": params, "buffers": [n for n, _ in run.buffers], "aliases": run.aliases}


def layout_section(run: RunView, exclude_frozen: bool, entries: dict) -> dict:
    """`entries`: layout_entries of the whole model (a pipeline's: every stage's, joined)."""
    return {"world_size": run.world, "zero_stage": run.stage, "dtype": run.dtype_name,
            **entries, "frozen_excluded": exclude_frozen,
            "optimizer": {"type": run.core.optimizer_type, "state_names": list(run.core.state_names),
                          EVERY_GROUP: run.groups_alike}}


# ----- client_state: JSON values and tensors, nothing else ---------------------------------------

_TENSOR, _TUPLE, _FLOAT = "__zeroshard_tensor__", "__zeroshard_tuple__", "__zeroshard_float__"
_STORABLE = tuple(_C.checkpoint.safetensors_dtypes().values())  # what a shard file can hold


def encode_client_state(state) -> tuple:
    """(JSON value, [(key, tensor)]): tensors become {"__zeroshard_tensor__": key}, tuples and
    non-finite floats are marked so they come back as they were. Anything else is a TypeError that
    names the key: a checkpoint holds no pickles."""
    return encode_values(state, "client_state", tensors=True)


def encode_values(state, where: str, tensors: bool = False):
    """encode_client_state for any section (`where` names it in errors); without `tensors`, a
    tensor is a TypeError too (a one-element one is taken as its number). Returns the JSON value,
    and the tensors' list when `tensors`."""
    found = []

    def enc(v, path):
        if isinstance(v, torch.Tensor):
            if not tensors and v.numel() == 1:
                return enc(v.item(), path)
            if not tensors:
                raise TypeError(f"save_checkpoint: {where}{path} is a tensor of {v.numel()} elements, "
                                "which this section cannot hold")
            if v.layout != torch.strided or v.dtype not in _STORABLE:
                raise TypeError(f"save_checkpoint: {where}{path} is a {v.layout} tensor of {v.dtype}, which "
                                f"a checkpoint cannot hold (dense tensors of {', '.join(map(str, _STORABLE))})")
            key = f"client/{len(found)}"
            found.append((key, v.detach()))
            return {_TENSOR: key}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {_FLOAT: repr(v)}
        if isinstance(v, dict):
            out = {}
            for k, item in v.items():
                if not isinstance(k, str):
                    raise TypeError(f"save_checkpoint: {where}{path}: key {k!r} is a "
                                    f"{type(k).__name__}; JSON keys are strings, so use str keys")
                out[k] = enc(item, f"{path}[{k!r}]")
            return out
        if isinstance(v, (list, tuple)):
            items = [enc(item, f"{path}[{i}]") for i, item in enumerate(v)]
            return {_TUPLE: items} if isinstance(v, tuple) else items
        raise TypeError(f"save_checkpoint: {where}{path} is a {type(v).__module__}."
                        f"{type(v).__qualname__}, which a checkpoint cannot hold: it stores JSON values "
                        "(dict, list, tuple, str, int, float, bool, None) and tensors, never pickles; "
                        "convert it, or save it in a file of your own")

    value = enc(state, "")
    return (value, found) if tensors else value


def decode_client_state(value, read_tensor=None):
    """The inverse of encode_values; read_tensor(key) gives a stored tensor."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return read_tensor(value[_TENSOR])
        if set(value) == {_TUPLE}:
            return tuple(decode_client_state(v, read_tensor) for v in value[_TUPLE])
        if set(value) == {_FLOAT}:
            return float(value[_FLOAT])
        return {k: decode_client_state(v, read_tensor) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, read_tensor) for v in value]
    return value
