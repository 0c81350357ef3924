"""Zero bubble's split backward (zeroshard/pipe/weight_pass.py), in one process: B then W gives
every input and weight exactly the gradient one whole backward gives, on graphs that make the
split hard (a weight used twice, a module called twice, an output that skips the input, a
parameter read outside its module, checkpointed segments, several outputs); and W does not
repeat B's work: B + W count the FLOPs of one backward."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from pipe_models import Block
from zeroshard.pipe.weight_pass import backward_input

D = 16


def Mlp():
    return Block(D)


class Twice(torch.nn.Module):
    """The same Linear called twice: its weight has two owners."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class Tied(torch.nn.Module):
    """One weight read at the start and at the end (an embedding-like tie within a chunk)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.mid = Mlp()

    def forward(self, x):
        return self.mid(x @ self.w) @ self.w.t()


class Outside(torch.nn.Module):
    """A parameter read by its parent outside its own module, plus a term without the input."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.scale = torch.nn.Parameter(torch.ones(D))

    def forward(self, x):
        return self.fc(x) * self.scale + F.linear(x, self.fc.weight) + self.scale.sum()


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Mlp(), Mlp()

    def forward(self, x):
        x = checkpoint(self.a, x, use_reentrant=False)
        return self.b(checkpoint(self.a, x, use_reentrant=False))


class TwoOutputs(torch.nn.Module):
    """A tuple out: one output uses the input, the other only a weight."""

    def __init__(self):
        super().__init__()
        self.mlp = Mlp()
        self.bias = torch.nn.Parameter(torch.randn(3, D))

    def forward(self, x):
        return self.mlp(x), torch.tanh(self.bias) * 2


MODELS = {"mlp": Mlp, "twice": Twice, "tied": Tied, "outside": Outside,
          "checkpointed": Checkpointed, "two_outputs": TwoOutputs}


def _outputs(model, x):
    out = model(x)
    return list(out) if isinstance(out, tuple) else [out]


def _grads_whole(model, x, out_grads, loss):
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    outs = _outputs(model, leaf)
    if loss:
        torch.autograd.backward([sum(o.square().mean() for o in outs)])
    else:
        torch.autograd.backward(outs, out_grads)
    return leaf.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def _grads_split(model, x, out_grads, loss):
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    outs = _outputs(model, leaf)
    roots, grads = ([sum(o.square().mean() for o in outs)], [None]) if loss else (outs, out_grads)
    weight_pass = backward_input(roots, grads, [leaf])
    input_grad = leaf.grad.clone()
    before_w = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    weight_pass.run()
    assert torch.equal(leaf.grad, input_grad), "W changed the input's gradient"
    return input_grad, {n: p.grad.clone() for n, p in model.named_parameters()}, before_w


@pytest.mark.parametrize("loss", [False, True], ids=["output_grads", "scalar_loss"])
@pytest.mark.parametrize("name", list(MODELS))
def test_split_backward_equals_whole_backward(name, loss):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(4, D)
    out_grads = [torch.randn_like(o) for o in _outputs(model, x)]
    whole_x, whole = _grads_whole(model, x, out_grads, loss)
    split_x, split, _ = _grads_split(model, x, out_grads, loss)
    torch.testing.assert_close(split_x, whole_x, rtol=1e-6, atol=1e-7)
    assert split.keys() == whole.keys()
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], rtol=1e-6, atol=1e-7, msg=f"{name}: {n}")


def test_weights_wait_for_w_and_twice_used_weights_come_in_b():
    """B leaves the Linear weights of an MLP to W; a weight with two owners is whole in B."""
    torch.manual_seed(0)
    for model, in_b in ((Mlp(), set()), (Twice(), {"fc.weight", "fc.bias"})):
        x = torch.randn(4, D)
        out_grads = [torch.randn(4, D)]
        _, _, before_w = _grads_split(model, x, out_grads, loss=False)
        got = {n for n, g in before_w.items() if g is not None}
        assert got == in_b, f"{type(model).__name__}: gradients present after B: {sorted(got)}"


def test_a_reentrant_checkpoint_is_named():
    model = Mlp()
    leaf = torch.randn(4, D, requires_grad=True)
    out = checkpoint(model, leaf, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=True.*use_reentrant=False"):
        backward_input([out], [torch.ones_like(out)], [leaf])


def _flops(fn):
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def test_b_plus_w_costs_one_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Mlp() for _ in range(4)])
    x = torch.randn(64, D)
    out_grads = [torch.randn(64, D)]

    def whole():
        leaf = x.detach().requires_grad_()
        torch.autograd.backward(model(leaf), out_grads[0])

    leaf = x.detach().requires_grad_()
    out = model(leaf)
    passes = {}
    b = _flops(lambda: passes.setdefault("w", backward_input([out], out_grads, [leaf])))
    w = _flops(passes["w"].run)
    full = _flops(whole) - _flops(lambda: model(x))
    assert b > 0 and w > 0
    assert b + w <= full * 1.001, f"B {b} + W {w} FLOPs against one backward's {full}"
    # A matmul's weight gradient is half its backward: W holds about half of it.
    assert 0.35 * full < w < 0.65 * full, f"W {w} of one backward's {full}"


class _Checkpointed(torch.nn.Module):
    """Blocks under zeroshard.checkpointing.checkpoint, as PipelineModule's
    activation_checkpoint_interval runs them."""

    def __init__(self, blocks=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Mlp() for _ in range(blocks))

    def forward(self, x):
        from zeroshard.checkpointing import checkpoint as zs_checkpoint
        for block in self.blocks:
            x = zs_checkpoint(block, x)
        return x


def test_a_checkpointed_segment_is_recomputed_once_in_b_plus_w():
    """torch recomputes a checkpointed segment once per backward call; W's replays would each
    recompute it, so the segment's weights come whole in B: B + W cost one backward."""
    torch.manual_seed(0)
    model = _Checkpointed()
    x = torch.randn(64, D)
    out_grads = [torch.randn(64, D)]

    def whole():
        leaf = x.detach().requires_grad_()
        out = model(leaf)
        return _flops(lambda: torch.autograd.backward(out, out_grads[0]))

    full = whole()
    whole_x, whole_grads = _grads_whole(model, x, out_grads, loss=False)
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    out = model(leaf)
    passes = {}
    b = _flops(lambda: passes.setdefault("w", backward_input([out], out_grads, [leaf])))
    w = _flops(passes["w"].run)
    assert b + w <= full * 1.001, f"B {b} + W {w} FLOPs against one backward's {full} (recompute included)"
    torch.testing.assert_close(leaf.grad, whole_x, rtol=1e-6, atol=1e-7)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole_grads[n], rtol=1e-6, atol=1e-7, msg=n)
