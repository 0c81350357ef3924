"""engine.save_checkpoint / engine.load_checkpoint (zeroshard/checkpoint) at the engine level:
6 steps, save, fresh processes load, 6 more steps equal 12 uninterrupted steps bit for bit (losses,
fp32 masters, Adam moments, 16-bit weights, counters, loss scaler, LR schedule, client_state), at
every ZeRO stage and precision; and every kind of bad input gives an error that names the thing."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

import checkpoint_workers as W
from harness import run_distributed

STEPS, SAVE_AT = 12, 6
WARMUP = ("WarmupLR", {"warmup_num_steps": 5})
COSINE = ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3})


def client_state():
    return {"epoch": 6, "nested": {"a": [1, 2.5, None]}, "t": torch.arange(3), "tup": (1, 2),
            "inf": float("inf")}


def plain(value):
    """client_state with tensors as ("tensor", values, dtype), so it crosses the result queue."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist(), str(value.dtype), tuple(value.shape))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


# ----- exact resume --------------------------------------------------------------------------------

# id -> (world, stage, precision, gradient_accumulation_steps, config scheduler, client scheduler)
RESUME_CASES = {
    "s0-fp32": (2, 0, "fp32", 1, WARMUP, None),
    "s0-bf16": (2, 0, "bf16", 1, COSINE, None),
    "s0-fp16-StepLR": (2, 0, "fp16", 1, None, "StepLR"),
    "s1-fp32-cosine": (2, 1, "fp32", 1, COSINE, None),
    "s1-bf16": (2, 1, "bf16", 1, WARMUP, None),
    "s1-fp16": (2, 1, "fp16", 1, WARMUP, None),
    "s2-fp32-gas2": (2, 2, "fp32", 2, WARMUP, None),
    "s2-bf16-LambdaLR": (2, 2, "bf16", 1, None, "LambdaLR"),
    "s2-fp16": (2, 2, "fp16", 1, COSINE, None),
    "s3-fp32": (2, 3, "fp32", 1, WARMUP, None),
    "s3-bf16-cosine": (2, 3, "bf16", 1, COSINE, None),
    "s3-fp16-LambdaLR": (2, 3, "fp16", 1, None, "LambdaLR"),
    "w3-s3-bf16": (3, 3, "bf16", 1, WARMUP, None),
}


def _case_config(case):
    world, stage, precision, gas, scheduler, client = RESUME_CASES[case]
    return W.config(stage, precision, micro=2, gas=gas, scheduler=scheduler), client


def first_half_worker(cases, root):
    """For each case: 12 uninterrupted steps; then a second engine runs 6, saves, and runs 6 more
    (which must not notice the save). Errors are returned per case."""
    results = {}
    for case in cases:
        cfg, client = _case_config(case)
        try:
            full = W.build("gpt", cfg, client)
            full_losses = W.train(full, "gpt", 0, STEPS)
            full_snap = W.snapshot(full)
            first = W.build("gpt", cfg, client)
            first_losses = W.train(first, "gpt", 0, SAVE_AT)
            saved_snap = W.snapshot(first)
            first.save_checkpoint(os.path.join(root, case), client_state=client_state())
            after_losses = W.train(first, "gpt", SAVE_AT, STEPS)
            results[case] = {"full_losses": full_losses, "full": full_snap, "first_losses": first_losses,
                             "saved": saved_snap, "after_save_losses": after_losses,
                             "after_save": W.snapshot(first)}
        except Exception:  # noqa: BLE001 - the case's test reports it
            import traceback
            results[case] = {"error": traceback.format_exc()}
    return results


def second_half_worker(case, root):
    cfg, client = _case_config(case)
    engine = W.build("gpt", cfg, client)
    path, state = engine.load_checkpoint(os.path.join(root, case))
    loaded = W.snapshot(engine)
    losses = W.train(engine, "gpt", SAVE_AT, STEPS)
    return {"path": path, "client": plain(state), "loaded": loaded, "losses": losses, "end": W.snapshot(engine)}


@pytest.fixture(scope="module")
def first_halves(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    results = {}
    for world in sorted({c[0] for c in RESUME_CASES.values()}):
        cases = [k for k, c in RESUME_CASES.items() if c[0] == world]
        for rank_result in run_distributed(first_half_worker, world, cases, root, timeout=300):
            for case, value in rank_result.items():
                results.setdefault(case, []).append(value)
    return root, results


COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "loss_scale", "lr", "group_steps")


def _assert_same_state(got, want, what):
    for key in COUNTERS:
        assert got[key] == want[key], f"{what}: {key} {got[key]!r} != {want[key]!r}"
    assert got["names"] == want["names"]
    for i, name in enumerate(want["names"]):
        assert W.equal_arrays([got["fp32"][i]], [want["fp32"][i]]), f"{what}: fp32 {name} differs"
        for s in want["states"]:
            assert W.equal_arrays([got["states"][s][i]], [want["states"][s][i]]), f"{what}: {s} of {name} differs"
    if "module" in want:
        assert got["module_dtype"] == want["module_dtype"]
        assert W.equal_arrays(got["module"], want["module"]), f"{what}: the module's weights differ"


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_exact_resume(case, first_halves):
    root, results = first_halves
    world, stage, precision, gas, _, _ = RESUME_CASES[case]
    for rank, r in enumerate(results[case]):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
    second = run_distributed(second_half_worker, world, case, root)
    full0 = results[case][0]["full"]
    if precision == "fp16":  # the scaler really moved, before and after the save
        assert results[case][0]["saved"]["skipped_steps"] > 0
        assert full0["skipped_steps"] > results[case][0]["saved"]["skipped_steps"]
    for rank, (first, got) in enumerate(zip(results[case], second)):
        assert first["first_losses"] + first["after_save_losses"] == first["full_losses"], \
            f"rank {rank}: saving changed the run"
        _assert_same_state(first["after_save"], first["full"], f"rank {rank}, the run that saved")
        assert got["path"] == os.path.join(root, case, f"global_step{SAVE_AT}")
        _assert_same_state(got["loaded"], first["saved"], f"rank {rank}, just after load")
        assert got["loaded"]["global_steps"] == SAVE_AT and got["loaded"]["micro_steps"] == SAVE_AT * gas
        assert got["losses"] == first["full_losses"][SAVE_AT * gas:], f"rank {rank}: losses after resume differ"
        _assert_same_state(got["end"], first["full"], f"rank {rank}, after resuming")
        assert got["end"]["global_steps"] == STEPS and got["end"]["global_samples"] == STEPS * 2 * gas * world
        c = got["client"]
        assert c == {"epoch": 6, "nested": {"a": [1, 2.5, None]}, "t": ("tensor", [0, 1, 2], "torch.int64", (3,)),
                     "tup": (1, 2), "inf": float("inf")}
        assert isinstance(c["tup"], tuple) and math.isinf(c["inf"])
