"""zeroshard.utils (DeepSpeed's deepspeed.utils): a parameter's whole fp32 value, gradient and
optimizer state assembled from the ranks' shards, at every stage, against torch.optim."""
import copy
import os

import pytest
import torch

from harness import run_distributed
from test_engine import _base_config


class _Model(torch.nn.Module):
    """Odd sizes (chunks and shards that split tensors unevenly) and a frozen layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x):
        return (self.frozen(self.b(torch.tanh(self.a(x)))) ** 2).mean()


def _batch(rank, step):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _reference_backward(reference, ref_opt, step, world):
    """The reference's gradients for the global batch: every rank's micro-batch."""
    ref_opt.zero_grad()
    for r in range(world):
        (reference(_batch(r, step)) / world).backward()


def _train(engine, reference, ref_opt, steps, start=0, dtype=torch.float32):
    """`steps` steps of the engine (its micro-batch in `dtype`) and of the reference."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for step in range(start, start + steps):
        engine.backward(engine(_batch(rank, step).to(dtype)))
        engine.step()
        _reference_backward(reference, ref_opt, step, world)
        ref_opt.step()


def full_values_worker(stage, precision, bucket):
    import zeroshard
    from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = _Model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.01)
    cfg = _base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                       zero_optimization={"stage": stage, "reduce_bucket_size": bucket})
    tol = dict(rtol=1e-5, atol=1e-6)
    if precision == "fp16":  # a static scale, so a gradient left scaled would be 128x off
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
        tol = dict(rtol=3e-2, atol=3e-3)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    assert safe_get_full_optimizer_state(named["a.weight"], "exp_avg") is None, "no state yet"
    with pytest.raises(ValueError, match="expected one of exp_avg, exp_avg_sq"):
        safe_get_full_optimizer_state(named["a.weight"], "momentum_buffer")
    assert safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))) is None
    assert safe_get_full_grad(named["a.weight"]) is None, "no backward yet"
    for step in range(3):
        x = _batch(rank, step)
        engine.backward(engine(x.half() if precision == "fp16" else x))
        _reference_backward(reference, ref_opt, step, world)
        ref = dict(reference.named_parameters())
        for n in trainable:
            grad = safe_get_full_grad(named[n])
            assert grad.dtype == torch.float32 and grad.shape == named[n].ds_shape \
                if stage == 3 else grad.shape == named[n].shape, n
            torch.testing.assert_close(grad, ref[n].grad, **tol, msg=lambda m: f"{n} grad: {m}")
        engine.step()
        ref_opt.step()
        for n in trainable:
            grad = safe_get_full_grad(named[n])
            assert grad is None, (n, "no gradient after the step", grad)
            torch.testing.assert_close(safe_get_full_fp32_param(named[n]), ref[n].detach(), **tol,
                                       msg=lambda m: f"{n} step {step}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(safe_get_full_optimizer_state(named[n], key),
                                           ref_opt.state[ref[n]][key], **tol,
                                           msg=lambda m: f"{n} {key} step {step}: {m}")
    engine.backward(engine(_batch(rank, 9).half() if precision == "fp16" else _batch(rank, 9)))
    assert safe_get_full_grad(named["a.weight"]) is not None
    engine.zero_grad()
    assert safe_get_full_grad(named["a.weight"]) is None, "no gradient after zero_grad()"
    frozen = named["frozen.weight"]
    if stage == 3:  # partitioned too: its whole value, and no gradient or state
        torch.testing.assert_close(safe_get_full_fp32_param(frozen), ref["frozen.weight"],
                                   **(tol if precision == "fp32" else dict(rtol=1e-3, atol=1e-3)))
        assert safe_get_full_grad(frozen) is None
        assert safe_get_full_optimizer_state(frozen, "exp_avg") is None
    else:  # left whole outside the engine, as DeepSpeed leaves frozen parameters below stage 3
        assert safe_get_full_fp32_param(frozen) is None


# Bucket 30 at stage 3: a.weight's chunks are reduced in pieces, so its gradient spans segments.
@pytest.mark.parametrize("stage,precision,world,bucket", [
    (0, "fp32", 2, 500000000), (1, "fp32", 2, 500000000), (2, "fp32", 2, 500000000),
    (3, "fp32", 2, 500000000), (3, "fp32", 3, 30), (2, "fp16", 2, 500000000)])
def test_full_values_match_torch_optim_at_every_stage(stage, precision, world, bucket):
    run_distributed(full_values_worker, world, stage, precision, bucket)


def set_values_worker(stage, precision):
    import zeroshard
    from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state)
    rank = int(os.environ["RANK"])
    model = _Model()
    reference = copy.deepcopy(model)
    ref = dict(reference.named_parameters())
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.01)
    # Threshold 10: the biases (8 and 3 elements) stay whole on every rank, the weights are chunked.
    cfg = _base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 10})
    tol = dict(rtol=1e-5, atol=1e-6)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        tol = dict(rtol=2e-2, atol=2e-2)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    named = dict(model.named_parameters())

    def rank0_value(name, seed, positive=False):
        """Rank 0's value, and another on every other rank: rank 0's must win."""
        v = torch.randn(ref[name].shape, generator=torch.Generator().manual_seed(seed + 100 * rank))
        expected = torch.randn(ref[name].shape, generator=torch.Generator().manual_seed(seed))
        return (v.abs(), expected.abs()) if positive else (v, expected)

    def visible(name):
        """The model-dtype value the module computes with (gathered at stage 3)."""
        with zeroshard.zero.GatheredParameters(named[name]):
            return named[name].detach().float().clone()

    # Before the first step: the state is created with the value, and the first step reads it.
    value, expected = rank0_value("a.bias", 1, positive=True)
    safe_set_full_optimizer_state(named["a.bias"], value.double(), "exp_avg_sq")
    ref_opt.state[ref["a.bias"]] = {"step": torch.tensor(0.0), "exp_avg_sq": expected.clone(),
                                    "exp_avg": torch.zeros_like(expected)}
    torch.testing.assert_close(safe_get_full_optimizer_state(named["a.bias"], "exp_avg_sq"), expected)

    model_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    _train(engine, reference, ref_opt, 2, dtype=model_dtype)
    with torch.no_grad():
        for name, seed in (("a.weight", 2), ("b.bias", 3)):  # chunked and persistent at stage 3
            value, expected = rank0_value(name, seed)
            safe_set_full_fp32_param(named[name], value)
            ref[name].copy_(expected)
            assert torch.equal(safe_get_full_fp32_param(named[name]), expected), name
            assert torch.equal(visible(name), expected.to(model_dtype).float()), name
        value, expected = rank0_value("b.weight", 4)
        # The size of exp_avg after a few steps: a larger one, over sqrt(exp_avg_sq), makes steps
        # that amplify bf16's rounding past any tolerance.
        value, expected = value * 1e-2, expected * 1e-2
        safe_set_full_optimizer_state(named["b.weight"], value, "exp_avg")
        ref_opt.state[ref["b.weight"]]["exp_avg"].copy_(expected)
        assert torch.equal(safe_get_full_optimizer_state(named["b.weight"], "exp_avg"), expected)
    if stage == 3:  # inside a GatheredParameters block the gathered tensor shows the value at once
        value, expected = rank0_value("b.weight", 5)
        with zeroshard.zero.GatheredParameters(named["b.weight"]):
            safe_set_full_fp32_param(named["b.weight"], value)
            if precision == "fp32":
                assert torch.equal(named["b.weight"].detach(), expected)
        with torch.no_grad():
            ref["b.weight"].copy_(expected)
        assert torch.equal(safe_get_full_fp32_param(named["b.weight"]), expected)
    _train(engine, reference, ref_opt, 3, start=2, dtype=model_dtype)
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        torch.testing.assert_close(safe_get_full_fp32_param(named[name]), ref[name].detach(), **tol,
                                   msg=lambda m: f"{name}: {m}")
        if precision == "bf16":  # bf16 gradients of the fp32 reference's are up to 8% off in exp_avg
            continue
        torch.testing.assert_close(safe_get_full_optimizer_state(named[name], "exp_avg"),
                                   ref_opt.state[ref[name]]["exp_avg"], **tol,
                                   msg=lambda m: f"{name} exp_avg: {m}")

    with pytest.raises(ValueError, match=r"shape is \[6, 8\], parameter 0's is \[8, 6\]"):
        safe_set_full_fp32_param(named["a.weight"], torch.zeros(6, 8))
    with pytest.raises(ValueError, match="expected one of exp_avg, exp_avg_sq"):
        safe_set_full_optimizer_state(named["a.weight"], torch.zeros(8, 6), "momentum_buffer")
    if stage == 3:
        with pytest.raises(ValueError, match="frozen; it has no optimizer state"):
            safe_set_full_optimizer_state(named["frozen.weight"], torch.zeros(3, 3), "exp_avg")
        safe_set_full_fp32_param(named["frozen.weight"], torch.eye(3))
        assert torch.equal(visible("frozen.weight"), torch.eye(3))
    else:
        with pytest.raises(ValueError, match="not a parameter the engine trains"):
            safe_set_full_fp32_param(named["frozen.weight"], torch.eye(3))


@pytest.mark.parametrize("stage,precision", [
    (0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")])
def test_set_values_are_rank0s_on_every_rank_and_training_continues_from_them(stage, precision):
    run_distributed(set_values_worker, 2, stage, precision)


def sgd_momentum_set_first_worker(stage):
    import zeroshard
    from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                 safe_set_full_optimizer_state)
    model = _Model()
    reference = copy.deepcopy(model)
    ref = dict(reference.named_parameters())
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
    cfg = _base_config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                       zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    named = dict(model.named_parameters())
    buf = torch.randn(8, 6, generator=torch.Generator().manual_seed(7)) * 0.1
    # Set before the first step: torch's SGD continues from a momentum buffer it finds, and seeds
    # one with the gradient only where there is none (a.bias here).
    safe_set_full_optimizer_state(named["a.weight"], buf, "momentum_buffer")
    ref_opt.state[ref["a.weight"]] = {"momentum_buffer": buf.clone()}
    _train(engine, reference, ref_opt, 3)
    for name in ("a.weight", "a.bias"):
        torch.testing.assert_close(safe_get_full_optimizer_state(named[name], "momentum_buffer"),
                                   ref_opt.state[ref[name]]["momentum_buffer"], rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(safe_get_full_fp32_param(named[name]), ref[name].detach(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_momentum_buffer_set_before_the_first_step_is_continued_as_torch_sgd_does(stage):
    run_distributed(sgd_momentum_set_first_worker, 2, stage)
