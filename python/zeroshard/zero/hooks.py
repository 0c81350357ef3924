"""ZeRO-3 module hooks: a module's parameters are gathered just before its forward and released
after it; an identity autograd node on its outputs gathers them again just before its backward.
The C++ coordinator (zeroshard._C.ParamCoordinator, over the ParamGatherer that owns the
parameters' gather state) decides when backward is done with them; for a module holding frozen
parameters, these hooks tell it when every autograd node the module's forward created has run
(_NodesRun), and whether that report may release anything is _C.FrozenRelease's decision
(zero/frozen_release.h)."""
import copy
import dataclasses

import torch

from zeroshard import _C
from zeroshard.graph import lowest_nodes_created

_EXTERNAL = "_zeroshard_external_params"
_HOOKS = "_zeroshard_hooks"  # a module's _ModuleHooks, once an engine hooks it

# The _ModuleHooks of the modules whose forward is under way, innermost last.
_RUNNING = []


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter):
    """Declares that `module`'s forward uses `parameter` although another module owns it, so it is
    gathered around `module` too (DeepSpeed's deepspeed.zero.register_external_parameter). Not
    needed for a read inside a forward, which gathers by itself, but honoured before and after
    initialize()."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError("register_external_parameter: expected a torch.nn.Module, got "
                         f"{type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError("register_external_parameter: expected a torch.nn.Parameter, got "
                         f"{type(parameter).__name__}")
    params = module.__dict__.setdefault(_EXTERNAL, [])
    if all(p is not parameter for p in params):
        params.append(parameter)
    hooks = module.__dict__.get(_HOOKS)
    core = getattr(parameter, "_zeroshard_core", None)
    if core is None or not core.strategy.partitions_params:
        return  # whole on every rank, or read when an engine hooks the module (install)
    if hooks is None or hooks.core is not core:
        raise ValueError(f"register_external_parameter: the parameter (ds_id {parameter.ds_id}) "
                         f"belongs to a ZeRO-3 engine whose model does not contain this "
                         f"{type(module).__name__}; register it with a module of that model")
    hooks.add_external(parameter._zeroshard_index)


class _ModuleHooks:
    """One module of an engine's model: its coordinator id (None while it uses no partitioned
    parameter; the coordinator numbers a module that joins later) and whether its forwards are
    tracked for frozen parameters. `core` is the engine's ZeroOptimizer (what identifies the
    engine), `coord` its stage-3 ParamCoordinator. Every module has one, so that a parameter read in any module's
    forward finds the module that reads it (see _GatherOnRead)."""
    __slots__ = ("core", "coord", "module_id", "starts", "policy")

    def __init__(self, core, policy):
        self.core, self.coord, self.policy = core, core.coordinator, policy
        self.module_id = self.starts = None

    # A copy or pickle of the module is not hooked by any engine (its hooks then do nothing).
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _nothing, ()

    def register(self, module_id, param_indices):
        self.module_id = module_id
        self.coord.register_module(module_id, param_indices)
        self._track_frozen()

    def _track_frozen(self):
        # Sequence numbers at the starts of its forwards (a stack: a module may call itself),
        # kept for a module whose frozen parameters need _NodesRun.
        if self.module_id is not None and self.starts is None and self.coord.holds_frozen(self.module_id):
            self.starts = []

    def _id(self):
        return -1 if self.module_id is None else self.module_id  # -1: the coordinator numbers it

    def _joined(self, module_id):
        # Only a parameter that joined can make the module hold frozen ones.
        if module_id >= 0:
            if self.module_id is None:
                self.module_id = module_id
            self._track_frozen()

    def read(self, index):
        """A partitioned parameter read in this module's forward: the coordinator decides whether
        it becomes this module's external parameter."""
        self._joined(self.coord.read_in_forward(self._id(), index))

    def add_external(self, index):
        if any(h is self for h in _RUNNING):
            self.read(index)  # gathered now if no running module holds it
        else:
            self._joined(self.coord.add_external(self._id(), index))


def _nothing():
    return None


class _GatherOnRead(dict):
    """module._parameters of a module holding partitioned parameters, as DeepSpeed's
    ZeROOrderedDict: reading one (module.weight) during another module's forward (a tied output
    embedding read in the parent's forward) makes the innermost running module of the same
    engine gather it and keep it as an external parameter. Reads by the owner's own forward, and
    reads outside every forward (which see the empty, partitioned parameter), cost one check."""
    __slots__ = ("owner",)

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        if _RUNNING and _RUNNING[-1] is not self.owner and p is not None:
            core = getattr(p, "_zeroshard_core", None)
            if core is not None and core.strategy.partitions_params:
                for hooks in reversed(_RUNNING):
                    if hooks.core is core:
                        hooks.read(p._zeroshard_index)
                        break
        return p

    # Copies and pickles of the module hold a plain dict (no engine comes with them).
    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)

    def __deepcopy__(self, memo):
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


def forget_running(core):
    """After a forward that raised: its modules are no longer running."""
    _RUNNING[:] = [h for h in _RUNNING if h.core is not core]


def empty_partition_cache(core):
    """engine.empty_partition_cache() at stage 3: releases every gathered parameter that nothing
    references (prefetched, or kept for reuse after a forward; a GatheredParameters block's stay,
    and persistent ones, which the gatherer keeps whole). The fetch-order trace is left alone, so
    a backward still pending gathers again what it needs and prefetching goes on. Every rank
    calls it at the same point: the gathers that follow are collectives, which a rank that kept
    its parameters would not join."""
    if any(h.core is core for h in _RUNNING):
        raise RuntimeError("empty_partition_cache: called while a forward of the engine's model runs "
                           "(from a module hook?); its parameters are in use. Call it between steps")
    core.gatherer.release_unreferenced()


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward gathers the module's parameters, so they are
    whole again before the module's own backward runs (autograd reaches this node first)."""

    @staticmethod
    def forward(ctx, coord, module_id, nodes_run, *tensors):
        ctx.coord, ctx.module_id, ctx.nodes_run = coord, module_id, nodes_run
        out = tuple(t.detach() for t in tensors)
        return out[0] if len(out) == 1 else out

    @staticmethod
    def backward(ctx, *grads):
        ctx.coord.fetch(ctx.module_id, True)
        if ctx.nodes_run is not None:
            ctx.nodes_run.arm()
        return (None, None, None) + grads


class _NodesRun:
    """One forward of a module holding frozen parameters, whose autograd nodes (on this thread)
    are all reachable from its outputs. Of the graph that forward built, only those nodes can
    have saved the frozen weights (the module's hooks gather them for its forward alone), and all
    run after this forward's _PreBackward. A node runs only after every node above it that runs
    in the same backward, so once the lowest ones (whose inputs come from outside the module)
    have run since _PreBackward, this backward is done with the weights. Nodes that a backward
    building a graph adds read them later, so FrozenRelease arms only in the engine's own
    backward, and only where every rank tracks the same forwards. Every backward over the graph
    (retain_graph) counts again from its _PreBackward. A forward run again during backward
    (checkpointing's recomputation) was held rather than released at its end, so its report
    covers that hold too (gathers=2): reentrant checkpointing runs a backward over the
    recomputed graph. Non-reentrant checkpointing does not; the first forward's nodes read what
    it saved, and the coordinator lets their report cover the hold."""

    __slots__ = ("coord", "module_id", "gathers", "total", "ran", "armed", "policy", "verdict")

    def __init__(self, coord, module_id, lowest, gathers, policy):
        self.coord, self.module_id, self.gathers, self.total = coord, module_id, gathers, len(lowest)
        self.ran, self.armed, self.policy, self.verdict = set(), False, policy, None
        for node in lowest:
            seq = node._sequence_nr()
            node.register_hook(lambda grad_inputs, grad_outputs, seq=seq: self.node_ran(seq))

    def arm(self):
        self.ran, self.armed = set(), self.policy.may_arm(self.verdict, torch.is_grad_enabled())
        if self.armed:
            self._check()

    def node_ran(self, seq):
        if self.armed:
            self.ran.add(seq)
            self._check()

    def _check(self):
        if len(self.ran) == self.total:
            self.armed = False
            self.coord.backward_nodes_done(self.module_id, self.gathers)


def _dataclass_fields(x):
    """The fields a dataclass instance is built from, or None for anything else."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [f.name for f in dataclasses.fields(x) if f.init]
    return None


def _map_outputs(output, fn):
    """`output` with its tensors (in tensors, lists, tuples, namedtuples, dicts and dataclasses,
    nested) replaced by fn(all of them)."""
    if torch.is_tensor(output):
        return fn([output])[0]
    tensors = []

    def collect(x):
        if torch.is_tensor(x):
            tensors.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)
        elif names := _dataclass_fields(x):
            for name in names:
                collect(getattr(x, name))
    collect(output)
    mapped = iter(fn(tensors)) if tensors else iter(())

    def rebuild(x):
        if torch.is_tensor(x):
            return next(mapped)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(rebuild(y) for y in x))
        if isinstance(x, (list, tuple)):
            return type(x)(rebuild(y) for y in x)
        if isinstance(x, dict):
            return type(x)((k, rebuild(v)) for k, v in x.items())
        names = _dataclass_fields(x)
        if names:
            # A shallow copy with the fields set directly: replace() would run __post_init__
            # again, and a field it transforms would be transformed twice.
            out = copy.copy(x)
            for n in names:
                object.__setattr__(out, n, rebuild(getattr(x, n)))
            return out
        return x
    return rebuild(output)


def install(core, module: torch.nn.Module, params, policy):
    """Registers every module that uses partitioned parameters with the coordinator and hooks every
    module. Returns the hooks' handles and whether some module holds partitioned frozen
    parameters."""
    index = {id(p): i for i, p in enumerate(params)}
    # Around everything else: the root's forward tells the coordinator whether this forward
    # builds a graph (a training iteration, ended by backward) or not (ended by the forward).
    handles = [module.register_forward_pre_hook(_begin_forward, prepend=True)]
    registered, any_frozen = 0, False
    for m in module.modules():
        if isinstance(m, _CONTAINERS) and m is not module:
            continue  # never runs a forward: the module that holds it reads its parameters
        hooks = _ModuleHooks(core, policy)
        m.__dict__[_HOOKS] = hooks
        _watch_reads(m, hooks, index)
        used = sorted({index[id(p)] for p in _used_parameters(m) if id(p) in index})
        if used:
            hooks.register(registered, used)
            registered += 1
            any_frozen = any_frozen or hooks.starts is not None
        handles.append(m.register_forward_pre_hook(_pre_forward))
        # always_call: a forward that ends in an exception still releases. Non-reentrant
        # checkpointing ends its recomputation that way as soon as it has what backward needs.
        handles.append(m.register_forward_hook(_post_forward, always_call=True))
    handles.append(module.register_forward_hook(_end_forward))
    return handles, any_frozen


# The hooks find their module's state when they run: a copy of the module (whose state is None)
# runs as a plain module instead of driving the original's engine.
def _begin_forward(module, args):
    hooks = module.__dict__.get(_HOOKS)
    if hooks is not None:
        forget_running(hooks.core)  # left by a forward that raised outside the engine
        hooks.coord.begin_forward(torch.is_grad_enabled())


def _end_forward(module, args, output):
    hooks = module.__dict__.get(_HOOKS)
    if hooks is not None:
        hooks.coord.end_forward()


def _watch_reads(m, hooks, index):
    """Gives m (and the parameter containers it holds) a _GatherOnRead, if it owns partitioned
    parameters; reads through a container count as reads by m."""
    containers = [m] + [c for c in m.children() if isinstance(c, _CONTAINERS)]
    for owner in containers:
        if isinstance(owner._parameters, _GatherOnRead) or not any(
                id(p) in index for p in owner._parameters.values() if p is not None):
            continue
        watched = _GatherOnRead(owner._parameters)
        watched.owner = hooks
        owner._parameters = watched
        if owner is not m:
            _watch_reads(owner, hooks, index)  # nested containers


# Parameter containers without a forward of their own.
_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)


def _used_parameters(m):
    """The parameters gathered around m's forward: its own, those of the ParameterList and
    ParameterDict it holds (at any depth), and those registered as external to it."""
    used = list(m.parameters(recurse=False))
    for child in m.children():
        if isinstance(child, _CONTAINERS):
            used += _used_parameters(child)
    return used + list(m.__dict__.get(_EXTERNAL, []))


def _pre_forward(module, args):
    hooks = module.__dict__.get(_HOOKS)
    if hooks is None:
        return
    _RUNNING.append(hooks)
    if hooks.module_id is None:
        return
    if hooks.starts is not None:
        hooks.starts.append(_C.autograd_sequence_number())
    hooks.coord.fetch(hooks.module_id, False)


def _post_forward(module, args, output):
    hooks = module.__dict__.get(_HOOKS)
    if hooks is None:
        return output
    if _RUNNING and _RUNNING[-1] is hooks:
        _RUNNING.pop()
    elif hooks in _RUNNING:  # an inner forward's hooks did not run (it raised first)
        del _RUNNING[len(_RUNNING) - 1 - _RUNNING[::-1].index(hooks):]
    coord, policy, module_id, starts = hooks.coord, hooks.policy, hooks.module_id, hooks.starts
    if module_id is None:
        return output
    end = _C.autograd_sequence_number()  # before _PreBackward adds its node
    start = starts.pop() if starts else None
    during_backward = torch._C._current_graph_task_id() != -1
    # Held only where the recomputation can save something for backward to read.
    held = coord.release(module_id, during_backward and torch.is_grad_enabled())
    if not torch.is_grad_enabled():
        return output

    def attach(tensors):
        grad = [t for t in tensors if t.requires_grad]
        if not grad:
            return tensors
        nodes_run = None
        # Within backward, saved-tensor hooks mean non-reentrant checkpointing's
        # recomputation (or the user's own hooks): its graph gets no backward of its own, and
        # when it runs depends on which node first needs it, which can differ between ranks
        # (no collective may depend on it). Only reentrant recomputations are tracked there.
        if start is not None and not (
                during_backward and torch._C._autograd._top_saved_tensors_default_hooks(False)):
            lowest = lowest_nodes_created(grad, start, end)
            if lowest is not None:
                nodes_run = _NodesRun(coord, module_id, lowest, 2 if held else 1, policy)
            if during_backward:
                verdict = policy.agree_now(nodes_run is not None) if policy.in_backward \
                    else _C.FrozenRelease.NEVER
            else:
                verdict = policy.record(nodes_run is not None)
            if nodes_run is not None:
                nodes_run.verdict = verdict
        wrapped = _PreBackward.apply(coord, module_id, nodes_run, *grad)
        wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
        return [next(wrapped) if t.requires_grad else t for t in tensors]

    return _map_outputs(output, attach)

