"""DeepSpeed's PipelineModule: a flat list of layers split into contiguous stages, each rank
building only its own (LayerSpec), weights tied across stages (TiedLayerSpec), and the
partition chosen by parameters, layer count or layer type. The engine (pipe/engine.py) runs it
through a schedule; forward(x, chunk) runs one model chunk of this rank."""
import functools
import re

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.comm import device as comm_device
from zeroshard.comm import init_distributed, new_comm
from zeroshard.log import all_ranks_log, log_rank0
from zeroshard.pipe.layers import LayerSpec, TiedLayerSpec
from zeroshard.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

PARTITION_METHODS = "'parameters', 'uniform' or 'type:<regex>'"


def _layer_name(layer):
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    kind = type(layer).__name__
    return kind if isinstance(layer, torch.nn.Module) else getattr(layer, "__name__", kind)


def _trainable_count(layer):
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # built only to count: nothing is allocated
            layer = layer.build()
    if not isinstance(layer, torch.nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _count_for_log(layer):
    """A layer's trainable parameters for the partition print, or None: a constructor that cannot
    run on the meta device (it reads a value, calls .item()) must not stop a start-up whose
    partition never needed the count."""
    try:
        return _trainable_count(layer)
    except Exception:  # noqa: BLE001 - any failure only leaves the printed count unknown
        return None


def partition_layers(layers, parts, method="parameters", counts=None):
    """Boundaries of `parts` contiguous stages over `layers` (stage s holds layers
    [bounds[s], bounds[s + 1])) by partition_method: "parameters" weighs each layer by its
    trainable parameters (`counts`, counted here when None), "uniform" by one, "type:<regex>" by
    whether its type matches. PipelineModule and the memory planner both split with it."""
    n = len(layers)
    lowered = method.lower() if isinstance(method, str) else method
    if lowered == "uniform":
        return list(_C.pipeline.partition_uniform(n, parts))
    if lowered == "parameters":
        weights = [float(c) for c in (counts if counts is not None else map(_trainable_count, layers))]
    elif isinstance(lowered, str) and lowered.startswith("type:"):
        pattern = method.split(":", 1)[1]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as error:
            raise ValueError(f"PipelineModule: partition_method {method!r}: bad regex: {error}")
        weights = [1.0 if regex.search(_layer_name(layer)) else 0.0 for layer in layers]
        if sum(weights) == 0:
            names = sorted({_layer_name(layer) for layer in layers})
            raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer; "
                             f"the layers' types are {names}")
    else:
        raise ValueError(f"PipelineModule: partition_method {method!r}, expected {PARTITION_METHODS}")
    return list(_C.pipeline.partition_balanced(weights, parts))


def _exec_range(funcs):
    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for f in funcs:
            x = f(x)
        return x
    return run


class PipelineModule(torch.nn.Module):
    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False,
                 seed_fn=None, base_seed=1234, partition_method="parameters",
                 activation_checkpoint_interval=0, activation_checkpoint_func=None,
                 checkpointable_layers=None, dynamic_shape=False, *, virtual_stages=1):
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: give num_stages or topology")
        if not isinstance(dynamic_shape, bool):
            raise ValueError(f"PipelineModule: dynamic_shape {dynamic_shape!r}, expected True or False")
        self.dynamic_shape = dynamic_shape  # what it does: pipe/p2p.py's StageLinks
        init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        if topology is None:
            if num_stages < 1 or world % num_stages:
                raise ValueError(f"PipelineModule: num_stages {num_stages} must divide the world "
                                 f"size {world} (the rest is the data-parallel axis)")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        axes = topology.get_axis_names()
        if "pipe" not in axes or "data" not in axes:
            raise ValueError(f"PipelineModule: the topology's axes are {axes}; it needs 'pipe' and 'data'")
        if any(topology.get_dim(a) > 1 for a in axes if a not in ("pipe", "data")):
            raise ValueError(f"PipelineModule: topology {dict(zip(axes, topology.dims))} has a model "
                             "(tensor-parallel) axis above 1; zeroshard has no tensor parallelism")
        if num_stages is not None and topology.get_dim("pipe") != num_stages:
            raise ValueError(f"PipelineModule: num_stages {num_stages} but the topology has "
                             f"{topology.get_dim('pipe')} pipe stages")
        if topology.world_size() != world:
            raise ValueError(f"PipelineModule: the topology holds {topology.world_size()} ranks, the "
                             f"world has {world}")
        if int(virtual_stages) < 1:
            raise ValueError(f"PipelineModule: virtual_stages {virtual_stages}, expected >= 1")
        # Which (stages, virtual_stages) a schedule runs is pipeline/schedule.cpp's rule alone:
        # the engine asks it (_C.pipeline.build) with the schedule and the micro-batches.
        self._topo = topology
        self._grid = PipelineParallelGrid(topology)
        self.global_rank = rank
        self.num_stages = topology.get_dim("pipe")
        self.stage_id = self._grid.stage_id
        self.virtual_stages = int(virtual_stages)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        if activation_checkpoint_func is None:
            from zeroshard.checkpointing import checkpoint as activation_checkpoint_func
        self.activation_checkpoint_func = activation_checkpoint_func
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, (list, tuple)):
            raise ValueError(f"PipelineModule: checkpointable_layers must be a list of class names, got "
                             f"{type(checkpointable_layers).__name__} {checkpointable_layers!r}")
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ValueError("PipelineModule: layers is empty")
        self.partition_method = partition_method
        # Boundaries over the p * v global stages: global stage s holds layers [parts[s], parts[s+1])
        # and lives on pipeline rank s % p as its model chunk s // p.
        self.parts = self._partition(partition_method)
        self.tied_modules = torch.nn.ModuleDict()  # checkpoints name a tie by this (zeroshard.tied_names)
        self.tied_weight_attrs = {}
        # Per model chunk: what forward calls in order, and the modules those calls use.
        self._chunk_funcs, self._chunk_modules = zip(*(self._build_chunk(c) for c in range(self.virtual_stages)))
        self._tied = self._index_tied_modules()
        # On the device first, as DeepSpeed's PipelineModule: NCCL broadcasts device tensors only.
        self.to(comm_device())
        self._synchronize_tied_weights()
        self._log_partition()

    def _zeroshard_engine_class(self):
        """The engine initialize() wraps this module in (zeroshard/engine.py asks)."""
        from zeroshard.pipe.engine import PipelineEngine
        return PipelineEngine

    # ----- layout -----
    def global_stage(self, chunk):
        return chunk * self.num_stages + self.stage_id

    @property
    def num_global_stages(self):
        return self.num_stages * self.virtual_stages

    @property
    def last_stage_rank(self):
        """The pipeline rank holding the last global stage (the loss, the labels)."""
        return (self.num_global_stages - 1) % self.num_stages

    def counts_tie(self, key):
        """Whether this stage is the tie's first owner, the one that counts and writes the tied
        weight (the gradient norm, checkpoints); the other owners hold copies."""
        return self.stage_id == self._tied[key][0][0]

    def topology(self):
        return self._topo

    def mpu(self):
        return self._grid

    def num_pipeline_stages(self):
        return self.num_stages

    def get_additional_losses(self):
        """DeepSpeed's hook for losses reported beside the loss (Megatron-DeepSpeed's MoE); none
        here. The engine refuses a module whose override returns any."""
        return None

    # ----- DeepSpeed's layout accessors (one model chunk per rank: with virtual_stages > 1 a
    # rank's layers are not one range) -----
    def partitions(self):
        return self.parts

    def stage_owner(self, layer_idx):
        """The pipeline rank that builds and runs layer `layer_idx`."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"stage_owner: layer {layer_idx}, the module has layers 0-{len(self._layer_specs) - 1}")
        stage = next(s for s in range(self.num_global_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])
        return stage % self.num_stages

    def _one_chunk(self, name):
        if self.virtual_stages > 1:
            # Not AttributeError: nn.Module would answer that with its own message (so hasattr()
            # raises too: these names are DeepSpeed's, whose modules have one chunk per rank).
            raise ValueError(f"PipelineModule.{name}: this rank holds {self.virtual_stages} model chunks "
                             "(virtual_stages), not one range of layers; see parts and global_stage(chunk)")
        return self.global_stage(0)

    @property
    def _local_start(self):
        return self.parts[self._one_chunk("_local_start")]

    @property
    def _local_stop(self):
        return self.parts[self._one_chunk("_local_stop") + 1]

    @property
    def forward_funcs(self):
        """What this stage's forward calls, in order (DeepSpeed's list)."""
        self._one_chunk("forward_funcs")
        return list(self._chunk_funcs[0])

    @property
    def layer_specs(self):
        """The layers as given (modules, LayerSpecs), in order; parts[s] indexes them."""
        return list(self._layer_specs)

    def _partition(self, method):
        parts = self.num_stages * self.virtual_stages
        n = len(self._layer_specs)
        if n < parts:
            raise ValueError(f"PipelineModule: {n} layers cannot fill {parts} stages "
                             f"({self.num_stages} pipeline stages x {self.virtual_stages} virtual); "
                             "every stage needs at least one layer")
        counts = self._layer_counts() if isinstance(method, str) and method.lower() == "parameters" else None
        return partition_layers(self._layer_specs, parts, method, counts)

    def _layer_counts(self):
        """Each layer's trainable parameters (a LayerSpec built once on the meta device to count),
        which partition_method "parameters" weighs the layers by."""
        if getattr(self, "_counts", None) is None:
            counts = []
            for idx, layer in enumerate(self._layer_specs):
                try:
                    counts.append(_trainable_count(layer))
                except Exception as error:  # noqa: BLE001 - named and re-raised as the user's
                    raise ValueError(f"PipelineModule: partition_method 'parameters' counts each layer's "
                                     f"parameters by building it on the meta device; layer {idx} "
                                     f"({_layer_name(layer)}) failed there: {type(error).__name__}: {error}. "
                                     "Use partition_method 'uniform' or 'type:<regex>'") from error
            self._counts = counts
        return self._counts

    def _log_partition(self):
        if self.global_rank != 0 and not all_ranks_log():
            return  # only rank 0 prints it: no rank builds layers on meta for nothing
        # "parameters" has counted already; the other methods need no count, so the print's
        # builds may fail (an unknown count, "?") without failing start-up.
        counts = (self._counts if getattr(self, "_counts", None) is not None
                  else [_count_for_log(layer) for layer in self._layer_specs])
        lines = []
        for s in range(self.num_global_stages):
            lo, hi = self.parts[s], self.parts[s + 1]
            names = [_layer_name(layer) for layer in self._layer_specs[lo:hi]]
            count = "?" if None in counts[lo:hi] else sum(counts[lo:hi])
            chunk = f" chunk {s // self.num_stages}" if self.virtual_stages > 1 else ""
            where = f"rank {s % self.num_stages}" + chunk
            lines.append(f"  stage {s} ({where}): layers {lo}-{hi - 1} {names} {count} parameters")
        log_rank0(f"pipeline partition by {self.partition_method!r} over {self.num_global_stages} "
                  "stages:\n" + "\n".join(lines), self.global_rank)

    # ----- building -----
    def _build_chunk(self, chunk):
        s = self.global_stage(chunk)
        funcs, modules = [], []
        for idx in range(self.parts[s], self.parts[s + 1]):
            spec = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                    self._check_tied_attrs(spec.key)
                module = self.tied_modules[spec.key]
                modules.append(module)
                if spec.forward_fn is None:
                    funcs.append(module)
                else:
                    funcs.append(lambda x, f=spec.forward_fn, m=module: f(m, x))
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.add_module(str(idx), module)
                funcs.append(module)
                modules.append(module)
            elif isinstance(spec, torch.nn.Module):
                self.add_module(str(idx), spec)
                funcs.append(spec)
                modules.append(spec)
            elif callable(spec):
                funcs.append(spec)
            else:
                raise ValueError(f"PipelineModule: layer {idx} is {spec!r}; expected an nn.Module, "
                                 "a LayerSpec, a TiedLayerSpec or a callable")
        return funcs, modules

    def _check_tied_attrs(self, key):
        module = self.tied_modules[key]
        for attr in self.tied_weight_attrs[key]:
            try:  # dotted names reach into submodules ("word_embeddings.weight"), as DeepSpeed's
                functools.reduce(getattr, attr.split("."), module)
            except AttributeError:
                raise ValueError(f"TiedLayerSpec({key!r}): tied_weight_attr {attr!r} is not an attribute "
                                 f"of the {type(module).__name__} it builds") from None
        named = dict(module.named_parameters())
        extra = [n for n in named if n not in self.tied_weight_attrs[key]]
        if extra:
            log_rank0(f"TiedLayerSpec({key!r}): its other parameters ({', '.join(extra)}) are kept equal "
                      "on every stage that uses it too (one module, as in one process; DeepSpeed "
                      "ties only tied_weight_attr)", self.global_rank)

    def _index_tied_modules(self):
        """key -> (owning pipeline ranks, this rank's communicator over them with its data
        index, or None). Every rank creates every group, in key order, as new_group requires."""
        owners = {}
        for idx, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                owners.setdefault(spec.key, set()).add(self.stage_owner(idx))
        tied = {}
        for key, ranks_set in owners.items():
            stages = sorted(ranks_set)
            comm = None
            if len(stages) > 1:
                for d in range(self._topo.get_dim("data")):
                    ranks = [self._grid.stage_to_global(s, data=d) for s in stages]
                    group = dist.new_group(ranks)
                    if self.global_rank in ranks:
                        comm = new_comm(group)
            tied[key] = (stages, comm)
        return tied

    def tied_weights(self, key):
        """(name, parameter) of everything a tie keeps equal on its stages: all of the tied
        module's parameters. A tied layer is one module, as it is in one process, so its other
        parameters (a bias beside tied_weight_attr's weight) are not left to drift apart per
        stage as DeepSpeed leaves them; the checkpoint then stores the one copy there is."""
        return list(self.tied_modules[key].named_parameters())

    def trained_tied_weights(self, key):
        """The tie's parameters that train (a frozen one has no gradient to sum)."""
        return [(n, w) for n, w in self.tied_weights(key) if w.requires_grad]

    def _synchronize_tied_weights(self):
        for key, (stages, comm) in self._tied.items():
            if comm is None:
                continue
            module = self.tied_modules[key]
            with torch.no_grad():
                for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                    comm.broadcast(tensor.data, 0, f"tied module {key}.{name} from stage {stages[0]}")

    def tied_groups(self):
        """(key, owning pipeline ranks, communicator) for the ties this rank takes part in."""
        return [(key, stages, comm) for key, (stages, comm) in self._tied.items() if comm is not None]

    # ----- running -----
    def _checkpointable(self, funcs):
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, torch.nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def chunk_parameters(self, chunk):
        """The trainable parameters model chunk `chunk` uses (tied ones included), once each."""
        seen, out = set(), []
        for module in self._chunk_modules[chunk]:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def forward(self, forward_input, chunk=0):
        funcs = self._chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return _exec_range(funcs)(forward_input)
        x = forward_input
        for start in range(0, len(funcs), interval):
            part = funcs[start:start + interval]
            inputs = x if isinstance(x, tuple) else (x,)
            if self._checkpointable(part):
                x = self.activation_checkpoint_func(_exec_range(part), *inputs)
            else:
                x = _exec_range(part)(*inputs)
        return x
