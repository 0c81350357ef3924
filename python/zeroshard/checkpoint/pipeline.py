"""Checkpoints of a pipeline engine (pipe/engine.py): which rank writes which of its stage's
pieces, the "pipeline" section, the stages' layout entries joined into one layout, and the
renaming that loads a pipeline checkpoint into the same layers without a pipeline (and back).

Names. PipelineModule names a parameter by its global layer index ("3.fc1.weight") whatever the
number of stages, so a checkpoint loads into any number of stages by name. A tied layer's module
is "tied_modules.<key>" on every stage that uses it: the checkpoint stores it once (its first
owning stage writes it) and every owner reads it. Without a pipeline the same layers are one
container whose children are named by layer index, a tied layer being one module used again;
there "tied_modules.<key>.<attr>" is "<first layer index that uses key>.<attr>" (the later uses
are aliases of it), which is how a load maps one onto the other."""
import json

from zeroshard.checkpoint.layout import Placement, renamed_key
from zeroshard.tied_names import TIED_MODULES as _TIED, tie_prefix

STAGE_LAYOUT = "stage_layout"  # a partial manifest's section: its stage's layout entries


def outside_layers(name):
    """A name that is neither a layer's ("<index>.") nor a tie's: what every stage holds besides
    its layers (the loss_fn module's buffers)."""
    head = name.split(".", 1)[0]
    return not head.isdigit() and not name.startswith(_TIED)


def placement_of(engine) -> Placement:
    """Each stage's data-parallel ranks split the stage's whole pieces among them; the first of
    them describes the stage; a tie is written by its first owning stage only, and what lies
    outside the layers (every stage holds the loss_fn module) by the last layer's stage only."""
    grid, module = engine._grid, engine.module
    not_written = set()
    for key, stages, _ in module.tied_groups():
        if not module.counts_tie(key):
            prefix = f"{_TIED}{key}."
            not_written |= {n for n, _ in module.named_parameters() if n.startswith(prefix)}
            not_written |= {n for n, _ in module.named_buffers() if n.startswith(prefix)}
    if module.stage_id != module.last_stage_rank:
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        not_written |= {n for n in names if outside_layers(n)}
    data_index = grid.get_data_parallel_id()
    return Placement(comm=engine._world_comm, part_rank=data_index,
                     part_world=grid.get_data_parallel_world_size(), describes=data_index == 0,
                     not_written=frozenset(not_written), names_split=module.num_stages > 1,
                     pipeline=pipeline_section(module))


def pipeline_section(module) -> dict:
    """What reloading elsewhere needs: the partition, and for each tie its weights and the layers
    that use it (every rank has the whole layer list, PipelineModule's own)."""
    from zeroshard.pipe.layers import TiedLayerSpec
    tied = {}
    for index, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            tie = tied.setdefault(spec.key, {"attrs": list(spec.tied_weight_attr), "layers": []})
            tie["layers"].append(index)
    return {"num_stages": module.num_stages, "virtual_stages": module.virtual_stages,
            "num_layers": len(module._layer_specs), "parts": [int(p) for p in module.parts],
            "tied": tied}


def split_partial(text: str):
    """(a rank's partial manifest without its stage's layout entries, those entries or None):
    the entries go into the one "layout" section, not into the merged manifest."""
    data = json.loads(text)
    entries = data.get("sections", {}).pop(STAGE_LAYOUT, None)
    return json.dumps(data), entries


def join_stage_layouts(section: dict, stages: list) -> dict:
    """Every stage's layout entries as one model's, in layer order (a tie at its first layer),
    which is the order the same layers have without a pipeline; a tie's names once."""
    params, buffers, aliases, seen = [], [], {}, set()
    for entries in stages:
        params += [p for p in entries["params"] if p["name"] not in seen]
        buffers += [b for b in entries["buffers"] if b not in seen]
        seen.update(p["name"] for p in entries["params"])
        seen.update(entries["buffers"])
        aliases.update(entries["aliases"])
    first = {f"{_TIED}{key}": tie["layers"][0] for key, tie in section["tied"].items()}

    def layer(name):
        if tie_prefix(name) is not None:
            return first.get(tie_prefix(name), 0)
        # What lies outside the layers (the loss_fn module) comes after them, as its use does.
        head = name.split(".", 1)[0]
        return int(head) if head.isdigit() else section["num_layers"]
    params.sort(key=lambda p: layer(p["name"]))
    buffers.sort(key=layer)
    return {"params": params, "buffers": buffers, "aliases": aliases}


def tied_renames(section: dict) -> dict:
    """{"tied_modules.<key>": "<first layer index that uses key>"} of a pipeline section."""
    return {f"{_TIED}{key}": str(tie["layers"][0]) for key, tie in section["tied"].items()}


def tie_groups(run) -> list:
    """The run's ties as [(layer indices, names)]: a pipeline's TiedLayerSpecs (names None: the
    whole module), or without a pipeline each parameter or buffer that several layers hold under
    one name ("1.weight" also "3.weight": ([1, 3], {"weight"})). A tensor shared under another
    name, or with a holder that is not a layer, is left out: a load names it as it differs."""
    if run.placement.pipeline is not None:
        return [(list(tie["layers"]), None) for tie in run.placement.pipeline["tied"].values()]
    shared = {}  # (first layer, name within it) -> the layers that hold that tensor
    for named in (run.module.named_parameters, run.module.named_buffers):
        first = {}
        for name, tensor in named(remove_duplicate=False):
            head, _, rest = name.partition(".")
            if not head.isdigit():
                continue
            t, t_rest = first.setdefault(id(tensor), (int(head), rest))
            if t_rest == rest:
                shared.setdefault((t, rest), {t}).add(int(head))
    return [(sorted(layers), {rest}) for (_, rest), layers in shared.items() if len(layers) > 1]


def tie_keys(run) -> dict:
    """{"tied_modules.<key>": "<first layer index that uses key>"} of the run's TiedLayerSpecs; none
    without a pipeline (a model's shared tensors have no keys)."""
    return {} if run.placement.pipeline is None else tied_renames(run.placement.pipeline)


def in_run_names(source, run):
    """`source` as the run names its tensors: itself, unless one side is a pipeline and the other
    is not (then its ties are renamed, see the module's docstring)."""
    saved, mine = source.section("pipeline"), run.placement.pipeline
    if (saved is None) == (mine is None):
        return source
    if saved is not None:  # a pipeline's checkpoint, a run without one
        return RenamedSource(source, {plain: tied for tied, plain in tied_renames(saved).items()})
    return RenamedSource(source, tied_renames(mine))


class RenamedSource:
    """A load source (sources.py) asked in the run's names; `to_stored` maps a run module prefix
    ("0") to the stored one ("tied_modules.embed")."""

    def __init__(self, source, to_stored: dict):
        self._source = source
        self._to_stored = to_stored
        self._to_run = {stored: run for run, stored in to_stored.items()}
        self.kind, self.path = source.kind, source.path
        self.masters_with_optimizer = source.masters_with_optimizer

    @staticmethod
    def _rename(name, table):
        for prefix, other in table.items():
            if name == prefix or name.startswith(prefix + "."):
                return other + name[len(prefix):]
        return name

    def _stored(self, key):
        return renamed_key(key, lambda n: self._rename(n, self._to_stored))

    def has(self, key):
        return self._source.has(self._stored(key))

    def open_all(self):
        self._source.open_all()

    def shape(self, key):
        return self._source.shape(self._stored(key))

    def dtype(self, key):
        return self._source.dtype(self._stored(key))

    def read(self, key, begin, out):
        self._source.read(self._stored(key), begin, out)

    def read_whole(self, key):
        return self._source.read_whole(key)  # client_state's, never renamed

    def section(self, name):
        value = self._source.section(name)
        if name != "layout" or value is None:
            return value
        run = lambda n: self._rename(n, self._to_run)  # noqa: E731
        return {**value, "params": [{**p, "name": run(p["name"])} for p in value["params"]],
                "buffers": [run(b) for b in value["buffers"]],
                "aliases": {run(a): run(b) for a, b in value.get("aliases", {}).items()}}
