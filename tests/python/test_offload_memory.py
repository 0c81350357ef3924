"""Where offload puts the model state (issue 19), from the runtime's own byte accounting: device
and host bytes per rank match the ZeRO-Offload formulas (bf16 Adam, stage 2: device 2P + 2P/N,
host 12P/N + staging), stage 3 keeps its live cap with both offloads, and a model whose fp32
master and Adam state do not fit a device-memory cap trains under it with offload."""
import os

import pytest

from harness import run_distributed
from models import global_batch, tiny_gpt

def owned_numel(stage, world, numels):
    """This rank's share of the flat parameters: stages 1-2 split one buffer padded to a multiple
    of world * 16; stage 3 holds a ceil(numel / world) chunk of every tensor."""
    if stage == 3:
        return sum((n + world - 1) // world for n in numels)
    unit = world * 16
    return (sum(numels) + unit - 1) // unit * unit // world


def expected_bytes(stage, precision, world, numels, offload_optimizer, offload_param):
    """This rank's model-state bytes by category at rest after a step (Adam, persistence threshold
    0, nothing gathered; stage 3's gradient shard is freed by the step), host_buffers and
    comm_buffers left out: what they hold depends on bucket and sub-group sizes."""
    half = 4 if precision == "fp32" else 2
    owned = owned_numel(stage, world, numels)
    whole = owned * world if stage != 3 else owned  # the parameters this rank keeps on the device
    grads = {1: owned * world, 2: owned, 3: 0}[stage]
    # The fp32 master: its own copy in mixed precision, and with offload in fp32 too (the device
    # keeps the fp32 parameters it computes with, the host the copy the step updates).
    master = 4 * owned if precision != "fp32" or offload_optimizer else 0
    out = {"parameters": half * whole, "gradients": half * grads, "master_weights": master,
           "optimizer_state": 8 * owned, "gathered_parameters": 0,
           "host_parameters": 0, "host_master_weights": 0, "host_optimizer_state": 0}
    if offload_optimizer:
        out["host_master_weights"], out["master_weights"] = master, 0
        out["host_optimizer_state"], out["optimizer_state"] = 8 * owned, 0
    if offload_param:
        out["host_parameters"], out["parameters"] = half * whole, 0
    return out


def _config(stage, precision, offload_optimizer=True, offload_param=False, **zero):
    block = {"stage": stage, "reduce_bucket_size": 1000, **zero}
    if stage == 3:
        block["stage3_param_persistence_threshold"] = 0
    if offload_optimizer:
        block["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        block["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": block}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train_step(engine, step):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loss = engine(global_batch("gpt", step, 2 * world)[2 * rank:2 * rank + 2])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _without(got, *names):
    return {k: v for k, v in got.items() if k not in names}


def accounting_worker(stage, precision, offload_optimizer, offload_param):
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    numels = [p.numel() for p in model.parameters()]
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage, precision, offload_optimizer,
                                                                  offload_param))
    expect = expected_bytes(stage, precision, world, numels, offload_optimizer, offload_param)
    owned = owned_numel(stage, world, numels)
    # The optimizer state comes with the first step, as without offload; stage 2's gradient shard
    # is there from the start.
    got = _without(engine.memory_bytes(), "comm_buffers", "host_buffers")
    assert got == dict(expect, optimizer_state=0, host_optimizer_state=0), (got, expect)
    staged = []
    for step in range(3):
        _train_step(engine, step)
        got = engine.memory_bytes()
        staged.append(got["host_buffers"])
        assert _without(got, "comm_buffers", "host_buffers") == expect, (step, got, expect)
    if offload_optimizer:
        # Gradients come down and updated parameters go up through the staging pool, which
        # reuses its buffers: it holds as much after the third step as after the first, and never
        # more than the shard's gradients in fp32 and its 16-bit parameters.
        assert 0 < staged[0] == staged[-1] <= 6 * owned, (staged, owned)
    if stage == 2 and precision == "bf16" and offload_optimizer:
        got = engine.memory_bytes()
        device = sum(got[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
        host = got["host_master_weights"] + got["host_optimizer_state"]
        assert device == 2 * owned * world + 2 * owned, got      # 2P + 2P/N (plus padding)
        assert host == 12 * owned, got                           # 12P/N (plus padding) + staging
    # The log line shows the two memories apart.
    assert "host" in engine._core.memory.summary(), engine._core.memory.summary()


# (stage, precision, offload_optimizer, offload_param), world 2, Adam.
ACCOUNTING = [(1, "fp32", True, False), (1, "bf16", True, False), (2, "bf16", True, False),
              (3, "bf16", True, False), (3, "bf16", True, True), (3, "fp32", True, True)]


@pytest.mark.parametrize("stage,precision,offload_optimizer,offload_param", ACCOUNTING,
                         ids=[f"stage{s}-{p}" + ("-optimizer" if o else "") + ("-param" if q else "")
                              for s, p, o, q in ACCOUNTING])
def test_offloaded_bytes_match_the_formula(stage, precision, offload_optimizer, offload_param):
    run_distributed(accounting_worker, 2, stage, precision, offload_optimizer, offload_param)


SUB_GROUP_NUMEL, RATIO = 1000, 0.4


def partial_worker():
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    numels = [p.numel() for p in model.parameters()]
    cfg = _config(2, "bf16", sub_group_size=SUB_GROUP_NUMEL)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = RATIO
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    owned = owned_numel(2, world, numels)
    _train_step(engine, 0)
    plan = engine._core.sub_groups(0)  # (begin, numel, residency) in the owned range
    assert [b for b, _, _ in plan] == [sum(n for _, n, _ in plan[:i]) for i in range(len(plan))], plan
    assert sum(n for _, n, _ in plan) == owned, (plan, owned)
    # DeepSpeed's rule: sub-group i steps on the host when i >= int((1 - ratio) * count).
    first_host = int((1 - RATIO) * len(plan))
    assert [r for _, _, r in plan] == ["device"] * first_host + ["host"] * (len(plan) - first_host), plan
    assert 0 < first_host < len(plan), plan                    # both sides have sub-groups
    host_numel = sum(n for _, n, r in plan if r == "host")
    got = engine.memory_bytes()
    # Each sub-group's master and Adam state live together, in exactly one place.
    assert got["host_master_weights"] == 4 * host_numel, (got, plan)
    assert got["host_optimizer_state"] == 8 * host_numel, (got, plan)
    assert got["master_weights"] == 4 * (owned - host_numel), (got, plan)
    assert got["optimizer_state"] == 8 * (owned - host_numel), (got, plan)


def test_partial_offload_splits_the_sub_groups_between_host_and_device():
    run_distributed(partial_worker, 2)


MAX_LIVE_NUMEL = 2500  # elements; more than the largest module (1088), far less than the model (7136)


def live_cap_worker():
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    numels = [p.numel() for p in model.parameters()]
    cfg = _config(3, "bf16", offload_param=True, stage3_max_live_parameters=MAX_LIVE_NUMEL,
                  stage3_prefetch_bucket_size=10 ** 6)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    owned = owned_numel(3, world, numels)
    device_peaks, gathered_peaks, gathered_bytes = [], [], []
    for step in range(3):
        engine._core.gatherer.reset_gathered_peak()
        engine._core.memory.reset_peaks()
        _train_step(engine, step)
        gathered_peaks.append(engine._core.gatherer.peak_gathered_numel)
        peak = engine._core.memory.peak_bytes()
        gathered_bytes.append(peak["gathered_parameters"])
        device_peaks.append(sum(v for k, v in peak.items()
                                if not k.startswith("host_") and k != "comm_buffers"))
    got = engine.memory_bytes()
    assert got["parameters"] == 0 and got["host_parameters"] == 2 * owned, got
    assert got["gathered_parameters"] == 0, got                  # everything released after backward
    # Step 1 records the module order on demand; later steps prefetch along it, within the cap.
    assert max(gathered_peaks[1:]) <= MAX_LIVE_NUMEL, gathered_peaks
    assert max(gathered_bytes[1:]) <= 2 * MAX_LIVE_NUMEL, gathered_bytes
    # The device holds the live gathered parameters and the gradient shard while backward runs;
    # no parameter chunk, master or optimizer state.
    assert max(device_peaks[1:]) <= 2 * MAX_LIVE_NUMEL + 2 * owned, (device_peaks, owned)


def test_zero3_with_both_offloads_keeps_the_live_cap():
    run_distributed(live_cap_worker, 2)


def capped_worker(stage, offload):
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    numels = [p.numel() for p in model.parameters()]
    cfg = _config(stage, "bf16", offload_optimizer=offload, offload_param=offload and stage == 3)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    losses = [_train_step(engine, step) for step in range(3)]
    device = ("parameters", "gradients", "master_weights", "optimizer_state", "gathered_parameters")
    peak = sum(engine._core.memory.peak_bytes()[k] for k in device)
    now = sum(engine.memory_bytes()[k] for k in device)
    return {"peak": peak, "now": now, "losses": losses,
            "padded_numel": owned_numel(1, world, numels) * world, "owned": owned_numel(stage, world, numels)}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_over_the_device_cap_trains_under_it_with_offload(stage):
    # The cap: 4 bytes a parameter on each rank's device. bf16 parameters and their gradient shard
    # fit (stage 2: 2P + 2P/N = 3P at N = 2; stage 3: 2P/N chunks or gradients plus what is
    # gathered, at most 2P); the fp32 master and Adam state alone (12P/N = 6P) do not.
    offloaded = run_distributed(capped_worker, 2, stage, True)
    resident = run_distributed(capped_worker, 2, stage, False)
    for rank in range(2):
        cap_bytes = 4 * offloaded[rank]["padded_numel"]
        assert 12 * offloaded[rank]["owned"] > cap_bytes, offloaded[rank]  # the cap means something
        # The sum of each category's peak bounds the device's peak from above.
        assert offloaded[rank]["peak"] <= cap_bytes, (offloaded[rank], cap_bytes)
        # The bytes held at rest bound the peak from below.
        assert resident[rank]["now"] > cap_bytes, (resident[rank], cap_bytes)
        for step, (a, b) in enumerate(zip(offloaded[rank]["losses"], resident[rank]["losses"])):
            assert abs(a - b) <= 2e-2 * abs(b), f"rank {rank} step {step}: loss {a} vs {b} without offload"
