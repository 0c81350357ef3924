"""ZeRO-3 module hooks: a module's parameters are gathered just before its forward and released
after it; an identity autograd node on its outputs gathers them again just before its backward.
The C++ coordinator (zeroshard._C.ZeroOptimizer) owns the parameters' state and decides when
backward is done with them."""
import torch

_EXTERNAL = "_zeroshard_external_params"


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter):
    """Declares that `module`'s forward uses `parameter` although another module owns it, so it is
    gathered around `module` too (DeepSpeed's deepspeed.zero.register_external_parameter)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError("register_external_parameter: expected a torch.nn.Parameter, got "
                         f"{type(parameter).__name__}")
    params = module.__dict__.setdefault(_EXTERNAL, [])
    if all(p is not parameter for p in params):
        params.append(parameter)


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward gathers the module's parameters, so they are
    whole again before the module's own backward runs (autograd reaches this node first)."""

    @staticmethod
    def forward(ctx, core, module_id, *tensors):
        ctx.core, ctx.module_id = core, module_id
        out = tuple(t.detach() for t in tensors)
        return out[0] if len(out) == 1 else out

    @staticmethod
    def backward(ctx, *grads):
        ctx.core.fetch(ctx.module_id, True)
        return (None, None) + grads


def _map_outputs(output, fn):
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
        return x
    return rebuild(output)


def install(core, module: torch.nn.Module, params):
    """Registers every module that uses partitioned parameters with the coordinator and hooks it."""
    index = {id(p): i for i, p in enumerate(params)}
    # Around everything else: the root's forward tells the coordinator whether this forward
    # builds a graph (a training iteration, ended by backward) or not (ended by the forward).
    handles = [module.register_forward_pre_hook(
        lambda m, args: core.begin_forward(torch.is_grad_enabled()), prepend=True)]
    module_id = 0
    for m in module.modules():
        used = list(m.parameters(recurse=False)) + list(m.__dict__.get(_EXTERNAL, []))
        ids = sorted({index[id(p)] for p in used if id(p) in index})
        if not ids:
            continue
        core.register_module(module_id, ids)
        handles.append(m.register_forward_pre_hook(_pre_forward(core, module_id)))
        # always_call: a forward that ends in an exception still releases. Non-reentrant
        # checkpointing ends its recomputation that way as soon as it has what backward needs.
        handles.append(m.register_forward_hook(_post_forward(core, module_id), always_call=True))
        module_id += 1
    handles.append(module.register_forward_hook(lambda m, args, output: core.end_forward()))
    return handles


def _pre_forward(core, module_id):
    def hook(module, args):
        core.fetch(module_id, False)
    return hook


def _post_forward(core, module_id):
    def attach(tensors):
        grad = [t for t in tensors if t.requires_grad]
        if not grad:
            return tensors
        wrapped = _PreBackward.apply(core, module_id, *grad)
        wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
        return [next(wrapped) if t.requires_grad else t for t in tensors]

    def hook(module, args, output):
        core.release(module_id)
        if not torch.is_grad_enabled():
            return output
        return _map_outputs(output, attach)
    return hook
