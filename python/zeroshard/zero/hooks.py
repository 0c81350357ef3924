"""ZeRO-3 module hooks: a module's parameters are gathered just before its forward and released
after it; an identity autograd node on its outputs gathers them again just before its backward.
A module with partitioned frozen parameters also gets an identity node on its inputs, whose
backward tells the coordinator that the module's backward is over (frozen parameters get no
gradient that could say so). The C++ coordinator (zeroshard._C.ZeroOptimizer) owns the
parameters' state."""
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


class _OnBackward(torch.autograd.Function):
    """Identity on tensors whose backward calls `event` once the gradients of all of them are
    final. On a module's outputs it gathers the module's parameters before the module's own
    backward runs (autograd reaches this node first); on its inputs it runs after every node of
    the module's backward that needs them."""

    @staticmethod
    def forward(ctx, event, *tensors):
        ctx.event = event
        out = tuple(t.detach() for t in tensors)
        return out[0] if len(out) == 1 else out

    @staticmethod
    def backward(ctx, *grads):
        ctx.event()
        return (None,) + grads


def _on_backward(tensors, event):
    """tensors with those that require grad replaced, in order, by one _OnBackward's outputs."""
    grad = [t for t in tensors if t.requires_grad]
    if not grad:
        return tensors
    wrapped = _OnBackward.apply(event, *grad)
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return [next(wrapped) if t.requires_grad else t for t in tensors]


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
        watches_inputs = core.register_module(module_id, ids)
        handles.append(m.register_forward_pre_hook(_pre_forward(core, module_id, watches_inputs),
                                                   with_kwargs=True))
        handles.append(m.register_forward_hook(_post_forward(core, module_id)))
        module_id += 1
    handles.append(module.register_forward_hook(lambda m, args, output: core.end_forward()))
    return handles


def _pre_forward(core, module_id, watches_inputs):
    def backward_done():
        core.input_grads_done(module_id)

    def hook(module, args, kwargs):
        core.fetch(module_id, False)
        if not watches_inputs or not torch.is_grad_enabled():
            return None
        wrapped = []

        def attach(tensors):
            out = _on_backward(tensors, backward_done)
            wrapped.append(out is not tensors)
            return out
        args, kwargs = _map_outputs((args, kwargs), attach)
        if not any(wrapped):
            return None
        core.expect_input_grads(module_id)
        return args, kwargs
    return hook


def _post_forward(core, module_id):
    def backward_starts():
        core.fetch(module_id, True)

    def hook(module, args, output):
        core.release(module_id)
        if not torch.is_grad_enabled():
            return output
        return _map_outputs(output, lambda tensors: _on_backward(tensors, backward_starts))
    return hook
