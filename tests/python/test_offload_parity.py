"""The numerics contract with CPU offload (issue 19): optimizer offload at stages 1-3 and parameter
offload at stage 3 give the same update as the single-process torch.optim reference, at
test_zero_parity.py's tolerances (fp32 1e-5 relative; bf16/fp16 as stated there), and the state
really lives where the config puts it. fp16 overflow skips the step on every rank with offload on."""
import os

import pytest
import torch

from harness import run_distributed
from models import global_batch, tiny_gpt
from test_zero_parity import ADAMW, STEPS, parity_worker

BUCKET = 700  # several gradient buckets; the 768- and 1024-element tensors are reduced in pieces
CLIP = 1.0    # the tiny GPT's gradient norm is 0.8-1.2: some steps clip, some do not


def _zero_block(stage, optimizer=True, param=False, ratio=1.0, pin=False, sub_group=None):
    """The zero_optimization block of one scenario. It replaces the block test_zero_parity's
    _config builds, so the stage-3 persistence threshold and the bucket size are set again."""
    block = {"stage": stage, "reduce_bucket_size": BUCKET}
    if stage == 3:
        block["stage3_param_persistence_threshold"] = 0  # every parameter partitioned (and offloaded)
    if optimizer:
        block["offload_optimizer"] = {"device": "cpu", "pin_memory": pin, "ratio": ratio}
    if param:
        block["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if sub_group is not None:
        block["sub_group_size"] = sub_group
    return block


def _assert_residency(engine, optimizer=True, param=False, ratio=1.0, **_):
    """A run that ignored the offload blocks would pass parity too: check where the state is."""
    got = engine.memory_bytes()
    device = {k: got[k] for k in ("master_weights", "optimizer_state")}
    host = {k: got["host_" + k] for k in ("master_weights", "optimizer_state")}
    if optimizer and ratio == 1.0:
        assert device == {"master_weights": 0, "optimizer_state": 0}, got
        assert all(v > 0 for v in host.values()), got
    elif optimizer:
        # Partial offload: the last sub-groups step on the host, the first ones on the device.
        assert got["optimizer_state"] > 0 and all(v > 0 for v in host.values()), got
    else:
        assert all(v == 0 for v in host.values()), got
    if param:
        assert got["parameters"] == 0 and got["host_parameters"] > 0, got
    else:
        assert got["host_parameters"] == 0 and got["parameters"] > 0, got


def _assert_early_copies(engine, stage):
    """At stages 2 and 3 every host sub-group's gradients came down during backward (the reducer
    reports each bucket's part final, padding included); at stage 1 (param.grad reachable) none."""
    host = sum(1 for g in range(len(engine.optimizer.param_groups))
               for _, _, where in engine._core.sub_groups(g) if where == "host")
    early = engine._core.last_step_times()["early_sub_groups"]
    assert early == (host if stage >= 2 else 0), (early, host, stage)


def parity_engine(model, stage, precision, gas, zero_block):
    """test_zero_parity's worker on `zero_block`, returning its engine for the checks of where
    the state is (the worker builds the engine itself; initialize is wrapped, in this rank's
    process only, to keep a handle on it)."""
    import zeroshard
    engines = []
    initialize = zeroshard.initialize

    def keep_engine(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engines.append(out[0])
        return out

    zeroshard.initialize = keep_engine
    try:
        parity_worker(model, stage, precision, gas, ADAMW, CLIP, BUCKET, STEPS, {"zero_optimization": zero_block})
    finally:
        zeroshard.initialize = initialize
    return engines[0]


def offload_parity_worker(stage, precision, gas, offload, model="gpt"):
    """test_zero_parity's worker on an offload config, then the residency check on its engine."""
    engine = parity_engine(model, stage, precision, gas, _zero_block(stage, **offload))
    _assert_residency(engine, **offload)
    _assert_early_copies(engine, stage)


OPT = {"optimizer": True}
OPT_PARAM = {"optimizer": True, "param": True}
PARAM_ONLY = {"optimizer": False, "param": True}
# Dimensions are paired rather than multiplied out (CI has two cores): every stage meets fp32,
# bf16 and fp16, GAS 1 and 2, worlds 1 and 2, and a world-4 run at stage 3; partial offload (ratio 0.4 with
# 1000-element sub-groups, so several sub-groups on each side) and pinned memory ride along.
# Parameter offload runs with the optimizer offloaded, partly offloaded (its device sub-groups
# write the host chunks through a device buffer) and on the device alone.
CASES = [
    # id                            stage precision gas world offload
    ("s1-fp32-gas1-w1",             1, "fp32", 1, 1, OPT),
    ("s1-fp32-gas2-w2",             1, "fp32", 2, 2, OPT),
    ("s1-bf16-gas1-w2-pin",         1, "bf16", 1, 2, dict(OPT, pin=True)),
    ("s1-fp16-gas2-w2",             1, "fp16", 2, 2, OPT),
    ("s1-fp32-gas1-w2-ratio0.4",    1, "fp32", 1, 2, dict(OPT, ratio=0.4, sub_group=1000)),
    ("s2-fp32-gas2-w1",             2, "fp32", 2, 1, OPT),
    ("s2-fp32-gas1-w2-subgroups",   2, "fp32", 1, 2, dict(OPT, sub_group=1000)),
    ("s2-bf16-gas2-w2",             2, "bf16", 2, 2, OPT),
    ("s2-bf16-gas1-w1-ratio0.4",    2, "bf16", 1, 1, dict(OPT, ratio=0.4, sub_group=1000)),
    ("s2-fp16-gas1-w2",             2, "fp16", 1, 2, OPT),
    ("s2-fp32-gas2-w2-ratio0.4",    2, "fp32", 2, 2, dict(OPT, ratio=0.4, sub_group=1000)),
    ("s3-fp32-gas1-w2",             3, "fp32", 1, 2, OPT),
    ("s3-bf16-gas2-w2",             3, "bf16", 2, 2, OPT),
    ("s3-fp16-gas1-w2",             3, "fp16", 1, 2, OPT),
    ("s3-fp32-gas2-w1-param",       3, "fp32", 2, 1, OPT_PARAM),
    ("s3-fp32-gas2-w2-param-pin",   3, "fp32", 2, 2, dict(OPT_PARAM, pin=True)),
    ("s3-bf16-gas1-w2-param",       3, "bf16", 1, 2, OPT_PARAM),
    ("s3-bf16-gas2-w4-param",       3, "bf16", 2, 4, OPT_PARAM),
    ("s3-fp16-gas2-w2-param",       3, "fp16", 2, 2, OPT_PARAM),
    ("s3-fp16-gas1-w1-param",       3, "fp16", 1, 1, OPT_PARAM),
    ("s3-fp32-gas1-w2-ratio0.4",    3, "fp32", 1, 2, dict(OPT, ratio=0.4, sub_group=1000)),
    ("s3-bf16-gas2-w2-ratio0.4",    3, "bf16", 2, 2, dict(OPT, ratio=0.4, sub_group=1000)),
    ("s3-bf16-gas1-w2-param-only",  3, "bf16", 1, 2, PARAM_ONLY),
    ("s3-fp32-gas2-w2-param-only",  3, "fp32", 2, 2, PARAM_ONLY),
    ("s3-bf16-gas2-w2-param-ratio0.4", 3, "bf16", 2, 2, dict(OPT_PARAM, ratio=0.4, sub_group=1000)),
]


def offload_parity_batch_worker(cases, model="gpt"):
    """Several cases in one set of rank processes (starting them costs more than a case): each
    builds its own engine, and a failure names its case."""
    for case_id, stage, precision, gas, _, offload in cases:
        try:
            offload_parity_worker(stage, precision, gas, offload, model)
        except Exception as e:
            raise AssertionError(f"case {case_id}: {e}") from e


def _batches(cases, size=4):
    """The cases grouped by world size, at most `size` to a group, as pytest parameters."""
    out = []
    for world in sorted({c[4] for c in cases}):
        same = [c for c in cases if c[4] == world]
        for i in range(0, len(same), size):
            group = same[i:i + size]
            out.append(pytest.param(world, group, id="+".join(c[0] for c in group)))
    return out


@pytest.mark.parametrize("world,cases", _batches(CASES))
def test_offload_parity(world, cases):
    run_distributed(offload_parity_batch_worker, world, cases, timeout=300)


# The awkward model: a frozen layer (at stage 3 partitioned into host chunks too), a parameter
# that gets no gradient, a layer used twice, and sizes that leave padding in the flat buffer.
AWKWARD = [
    ("s2-fp32-gas2-w2", 2, "fp32", 2, 2, OPT),
    ("s3-fp32-gas1-w2-param", 3, "fp32", 1, 2, OPT_PARAM),
    ("s3-fp32-gas2-w2-param-only", 3, "fp32", 2, 2, PARAM_ONLY),  # (its inputs are fp32)
]


@pytest.mark.parametrize("world,cases", _batches(AWKWARD))
def test_offload_parity_with_frozen_unused_and_padded_parameters(world, cases):
    run_distributed(offload_parity_batch_worker, world, cases, "awkward", timeout=300)


# ----- fp16 overflow with offload: every rank skips, the scale drops -----

class _InfGrad(torch.autograd.Function):
    """Identity forward; backward hands back +inf everywhere (an fp16 overflow, made on purpose)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


OVERFLOW_STEP, OVERFLOW_RANK = 2, 1


def overflow_worker(stage, offload):
    import zeroshard
    rank = int(os.environ["RANK"])
    model = tiny_gpt()
    armed = [False]

    # Only rank 1 overflows, and only in the token embedding: at stages 1-2 that is the first
    # tensor of rank 0's shard, so rank 1's own shard stays finite and it must learn of the
    # overflow from rank 0 (at stage 3 both ranks hold a chunk of it).
    def poison(module, args, out):
        return _InfGrad.apply(out) if armed[0] else out
    model.tok.register_forward_hook(poison)
    zero = _zero_block(stage, **offload) if offload else _zero_block(stage, optimizer=False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": ADAMW, "gradient_clipping": CLIP, "zero_optimization": zero,
           # A scale that never overflows by itself; hysteresis 1 lowers it at the first overflow.
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    initial = engine._core.master(0).clone()
    applied, scales = [], []
    for step in range(6):
        armed[0] = step == OVERFLOW_STEP and rank == OVERFLOW_RANK
        loss = engine(global_batch("gpt", step, 4)[2 * rank:2 * rank + 2])
        engine.backward(loss)
        before = engine._core.master(0).clone()
        engine.step()
        applied.append(engine.was_step_applied())
        scales.append(engine.get_loss_scale())
        if step == OVERFLOW_STEP:
            # The skipped step leaves the (host) master exactly as it was.
            assert torch.equal(engine._core.master(0), before), f"rank {rank}: skipped step moved the master"
    armed[0] = False
    assert applied == [s != OVERFLOW_STEP for s in range(6)], f"rank {rank}: {applied}"
    assert scales[:OVERFLOW_STEP] == [256.0] * OVERFLOW_STEP, scales
    assert scales[OVERFLOW_STEP:] == [128.0] * (6 - OVERFLOW_STEP), scales
    assert engine.skipped_steps == 1
    master = engine._core.master(0)
    assert torch.isfinite(master).all(), f"rank {rank}: the overflow reached the master"
    if offload:
        _assert_residency(engine, **offload)
    return {"applied": applied, "scales": scales, "initial": initial.tolist(), "master": master.tolist()}


@pytest.mark.parametrize("stage,offload", [(1, dict(OPT, ratio=0.4, sub_group=1000)), (2, OPT),
                                           (3, OPT_PARAM)],
                         ids=["stage1-ratio0.4", "stage2", "stage3-param"])
def test_fp16_overflow_skips_on_every_rank_with_offload(stage, offload):
    with_offload = run_distributed(overflow_worker, 2, stage, offload)
    without = run_distributed(overflow_worker, 2, stage, None)
    for rank in range(2):
        a, b = with_offload[rank], without[rank]
        assert a["applied"] == b["applied"] and a["scales"] == b["scales"], (a["scales"], b["scales"])
        # The same updates as without offload, at the fp16 parity tolerance (the kernels may differ
        # in rounding, which fp16's copy of the parameters can amplify a little).
        got, ref, init = (torch.tensor(a["master"]), torch.tensor(b["master"]),
                          torch.tensor(b["initial"]))
        assert torch.equal(torch.tensor(a["initial"]), init)
        err, moved = (got - ref).norm().item(), (ref - init).norm().item()
        assert err <= 0.1 * moved, f"rank {rank}: offload master off by {err:.3e}, moved {moved:.3e}"
