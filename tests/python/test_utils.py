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
    for step in range(3):
        x = _batch(rank, step)
        engine.backward(engine(x.half() if precision == "fp16" else x))
        ref_opt.zero_grad()
        for r in range(world):  # the global batch: every rank's micro-batch
            (reference(_batch(r, step)) / world).backward()
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
            # After the step: stages 0/1 have no gradient; 2/3 hold zeroed shards.
            assert grad is None if stage < 2 else not grad.any(), (n, grad)
            torch.testing.assert_close(safe_get_full_fp32_param(named[n]), ref[n].detach(), **tol,
                                       msg=lambda m: f"{n} step {step}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(safe_get_full_optimizer_state(named[n], key),
                                           ref_opt.state[ref[n]][key], **tol,
                                           msg=lambda m: f"{n} {key} step {step}: {m}")
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
