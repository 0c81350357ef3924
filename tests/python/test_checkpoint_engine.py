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
from models import AwkwardMLP, global_batch

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

SGD = {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}
LION = {"type": "Lion", "params": {"lr": 1e-4}}

# id -> (world, stage, precision, gradient_accumulation_steps, config scheduler, client scheduler[,
# optimizer]); AdamW unless named
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
    "s2-fp32-SGD": (2, 2, "fp32", 1, WARMUP, None, SGD),
    "s3-bf16-Lion": (2, 3, "bf16", 1, None, None, LION),
}


def _case_config(case):
    world, stage, precision, gas, scheduler, client, *optimizer = RESUME_CASES[case]
    extra = {"optimizer": optimizer[0]} if optimizer else None
    return W.config(stage, precision, micro=2, gas=gas, scheduler=scheduler, extra=extra), client


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
    world, stage, precision, gas = RESUME_CASES[case][:4]
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


def plateau_worker(root):
    """ReduceLROnPlateau, driven through engine.step(lr_kwargs=...) as DeepSpeed scripts do; its
    state holds inf (mode_worse, and best until a metric is seen)."""
    import zeroshard
    cfg = W.config(1)
    out = {}
    model = W.MODELS["gpt"]()
    engine, _, _, scheduler = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    for step, metric in enumerate((1.0, 2.0, 3.0)):  # worse and worse: the lr halves twice
        loss = engine(global_batch("gpt", step, 2))
        engine.backward(loss)
        engine.step(lr_kwargs={"metrics": metric})
    out["saved"] = (scheduler.state_dict(), engine.get_lr())
    try:
        engine.save_checkpoint(root)
    except Exception as e:  # noqa: BLE001
        out["save_error"] = f"{type(e).__name__}: {e}"
        return out
    model = W.MODELS["gpt"]()
    fresh, _, _, fresh_scheduler = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    fresh.load_checkpoint(root)
    out["loaded"] = (fresh_scheduler.state_dict(), fresh.get_lr())
    return out


def test_client_scheduler_with_infinite_state(tmp_path):
    (r,) = run_distributed(plateau_worker, 1, str(tmp_path))
    state, lr = r["saved"]
    assert lr == [W.LR / 4] and math.isinf(state["mode_worse"])
    assert "save_error" not in r, f"a ReduceLROnPlateau run cannot save: {r.get('save_error')}"
    assert r["loaded"] == r["saved"]


# ----- bad input: a clear error that names the thing, and nothing lost -----------------------------

class AwkwardRenamed(AwkwardMLP):
    """AwkwardMLP with `out` renamed to `head` and `unused` reshaped (5x5 -> 6x5)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(5, 6)
        self.head = self.out
        del self.out

    def forward(self, batch):
        x, y = batch[:, :7], batch[:, 7:10]
        h = torch.tanh(self.frozen(x))
        h = torch.tanh(self.hidden(torch.tanh(self.hidden(h))))
        return ((self.head(h) - y) ** 2).mean()


class Sampler:
    """A user object in client_state, which a checkpoint must refuse (no pickles)."""


def _outcome(fn):
    """('ok', value) or (exception class name, message)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def _log_lines():
    """Every zeroshard log line this process prints from now on."""
    import logging
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    return lines


BAD_STAGE = 3  # the saving run: frozen parameters partitioned too


def bad_save_worker(root):
    """World 2: DeepSpeed-style saves at steps 2 and 4, then saves that must fail and write nothing."""
    import argparse
    rank, _ = W.rank_and_world()
    args = argparse.Namespace(save_dir=os.path.join(root, "ckpt"))
    engine = W.build("awkward", W.config(BAD_STAGE))
    out = {}
    for n in (2, 4):
        W.train(engine, "awkward", n - 2, n)
        engine.save_checkpoint(args.save_dir, tag=f"step{n}", client_state={"step": n})
        out[f"step{n}"] = W.snapshot(engine)
    out["client_object"] = _outcome(lambda: engine.save_checkpoint(
        args.save_dir, tag="bad", client_state={"epoch": 1, "extra": {"sampler": Sampler()}}))
    out["nolatest"] = _outcome(lambda: engine.save_checkpoint(args.save_dir, tag="nolatest", save_latest=False))
    sgd = W.build("awkward", W.config(BAD_STAGE, extra={"optimizer": SGD}))
    W.train(sgd, "awkward", 0, 1)
    sgd.save_checkpoint(os.path.join(root, "sgd"))
    out["sgd"] = W.snapshot(sgd)
    strict = W.build("awkward", W.config(BAD_STAGE, extra={"checkpoint": {"tag_validation": "Fail"}}))
    out["tag_fail"] = _outcome(lambda: strict.save_checkpoint(args.save_dir, tag=f"rank{rank}"))
    # Warn (the default) and Ignore: the save goes on, as in DeepSpeed, under one tag.
    lines = _log_lines()
    out["tag_warn"] = _outcome(lambda: engine.save_checkpoint(os.path.join(root, "warn"), tag=f"warn{rank}"))
    out["tag_warn_log"] = [line for line in lines if "different tags" in line]
    lenient = W.build("awkward", W.config(BAD_STAGE, extra={"checkpoint": {"tag_validation": "Ignore"}}))
    W.train(lenient, "awkward", 0, 1)
    out["tag_ignore"] = _outcome(lambda: lenient.save_checkpoint(os.path.join(root, "ignore"), tag=f"ign{rank}"))
    return out


def bad_load_worker(root, saved):
    """World 1, stage 2 (a reshard from the saving run), every load of the list in its own engine."""
    import argparse
    ckpt = os.path.join(root, "ckpt")
    cfg = W.config(2)
    out = {}

    def unlike(model):
        """The frozen layer moved off the saved values, so that a load that misses it shows."""
        with torch.no_grad():
            model.frozen.weight.add_(1.0)
        return model

    def fresh():
        return W.build_module(unlike(AwkwardMLP()), cfg)

    out["missing_dir"] = _outcome(lambda: fresh().load_checkpoint(os.path.join(root, "nowhere")))
    out["no_latest"] = _outcome(lambda: fresh().load_checkpoint(os.path.join(root, "empty")))
    out["missing_tag"] = _outcome(lambda: fresh().load_checkpoint(ckpt, tag="step99"))
    for name in ("truncated", "corrupted", "version99", "missing_file"):
        out[name] = _outcome(lambda: fresh().load_checkpoint(os.path.join(root, name), tag="step4"))

    # The DeepSpeed example scripts' pattern.
    args = argparse.Namespace(load_dir=ckpt, ckpt_id="step2")
    engine = fresh()
    _, client_sd = engine.load_checkpoint(args.load_dir, args.ckpt_id)
    step = client_sd["step"]
    out["ds_pattern"] = {"step": step, "snap": W.snapshot(engine)}
    engine = fresh()
    out["latest"] = {"result": engine.load_checkpoint(ckpt), "snap": W.snapshot(engine)}

    # Renamed and reshaped parameters: strict names them; not strict loads the rest and warns.
    renamed_cfg = W.config(2)
    out["strict"] = _outcome(lambda: W.build_module(unlike(AwkwardRenamed()), renamed_cfg).load_checkpoint(ckpt))
    engine = W.build_module(unlike(AwkwardRenamed()), renamed_cfg)
    before = W.module_state(engine)
    lines = _log_lines()
    out["not_strict"] = {"result": _outcome(lambda: engine.load_checkpoint(ckpt, load_module_strict=False)),
                         "before": before, "after": W.module_state(engine), "log": lines}

    # load_optimizer_states=False and load_module_only=True: a run that has trained (other data).
    partial_loads = (("no_optimizer", {"load_optimizer_states": False}), ("module_only", {"load_module_only": True}))
    for key, kwargs in partial_loads:
        engine = fresh()
        W.train(engine, "awkward", 100, 101)
        before = W.snapshot(engine)
        result = _outcome(lambda: engine.load_checkpoint(ckpt, **kwargs))
        out[key] = {"result": result, "before": before, "after": W.snapshot(engine)}

    out["tag_warn"] = _outcome(lambda: fresh().load_checkpoint(os.path.join(root, "warn")))

    # A checkpoint of another optimizer, into a run that has not stepped yet (a resume).
    engine = fresh()
    before = W.snapshot(engine)
    out["other_optimizer"] = {"result": _outcome(lambda: engine.load_checkpoint(os.path.join(root, "sgd"))),
                              "before": before, "after": W.snapshot(engine)}
    engine = fresh()
    out["other_optimizer_weights"] = {
        "result": _outcome(lambda: engine.load_checkpoint(os.path.join(root, "sgd"), load_optimizer_states=False)),
        "after": W.snapshot(engine)}

    out["custom_load_fn"] = _outcome(lambda: fresh().load_checkpoint(ckpt, custom_load_fn=lambda *a, **k: None))
    universal = W.build("awkward", W.config(2, extra={"checkpoint": {"load_universal": True}}))
    out["load_universal"] = _outcome(lambda: universal.load_checkpoint(ckpt))
    return out


def _safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad"))
    # What a save killed half-way leaves: the next save removes it.
    os.makedirs(os.path.join(root, "ckpt", ".tmp-step0-crashed"))
    with open(os.path.join(root, "ckpt", ".tmp-step0-crashed", "rank00000.safetensors"), "wb") as f:
        f.write(b"half")
    saves = run_distributed(bad_save_worker, 2, root)
    ckpt = os.path.join(root, "ckpt")
    listing = sorted(os.listdir(ckpt))  # the crashed save's .tmp-* is gone too
    os.makedirs(os.path.join(root, "empty"))
    for name in ("truncated", "corrupted", "version99", "missing_file"):
        shutil.copytree(os.path.join(ckpt, "step4"), os.path.join(root, name, "step4"))
    victim = "rank00001.safetensors"
    path = os.path.join(root, "truncated", "step4", victim)
    os.truncate(path, os.path.getsize(path) // 2)
    path = os.path.join(root, "corrupted", "step4", victim)
    data_start, header = _safetensors_header(path)
    with open(path, "r+b") as f:  # one byte inside a tensor's data; the header stays valid
        f.seek(data_start + header["optim/exp_avg/hidden.weight"]["data_offsets"][0] + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    path = os.path.join(root, "version99", "step4", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["format_version"] = 99
    with open(path, "w") as f:
        json.dump(manifest, f)
    os.remove(os.path.join(root, "missing_file", "step4", victim))
    loads = run_distributed(bad_load_worker, 1, root, saves[0])[0]
    listings = {d: sorted(os.listdir(os.path.join(root, d))) if os.path.isdir(os.path.join(root, d)) else None
                for d in ("warn", "ignore")}
    with open(os.path.join(ckpt, "latest")) as f:
        latest = f.read().strip()
    return {"root": root, "listing": listing, "listings": listings, "saves": saves, "loads": loads,
            "latest": latest}


def test_failed_saves_write_nothing(bad_inputs):
    saves = bad_inputs["saves"]
    for rank, s in enumerate(saves):
        kind, message = s["client_object"]
        assert kind == "TypeError", (rank, s["client_object"])
        assert "client_state['extra']['sampler']" in message and "Sampler" in message, message
        kind, message = s["tag_fail"]  # every rank raises, not only the one that noticed
        assert kind == "ValueError" and "tag" in message and "Fail" in message, (rank, s["tag_fail"])
        assert s["nolatest"] == ("ok", True)
    # Only the good saves are there: no "bad" or "rank<N>" tag, no temporary directory left (not even
    # the one a crashed save left before these).
    assert bad_inputs["listing"] == ["latest", "nolatest", "step2", "step4"], bad_inputs["listing"]
    assert bad_inputs["latest"] == "step4"  # save_latest=False left it alone


def test_ranks_passing_different_tags_under_warn_and_ignore(bad_inputs):
    """checkpoint.tag_validation Warn (the default) warns and Ignore says nothing; either way the save
    goes on (as DeepSpeed's does), under one tag on every rank: rank 0's."""
    saves = bad_inputs["saves"]
    for key in ("tag_warn", "tag_ignore"):
        outcomes = [s[key] for s in saves]
        assert all(o == ("ok", True) for o in outcomes), f"{key}: " + "; ".join(
            f"rank {rank}: {kind}: {message}" for rank, (kind, message) in enumerate(outcomes))
    assert len(saves[0]["tag_warn_log"]) == 1, saves[0]["tag_warn_log"]
    assert bad_inputs["listings"] == {"warn": ["latest", "warn0"], "ignore": ["ign0", "latest"]}, bad_inputs["listings"]
    assert bad_inputs["loads"]["tag_warn"][0] == "ok", bad_inputs["loads"]["tag_warn"]


def test_missing_directory_and_tag(bad_inputs):
    loads, root = bad_inputs["loads"], bad_inputs["root"]
    kind, message = loads["missing_dir"]
    assert kind == "FileNotFoundError" and os.path.join(root, "nowhere") in message, loads["missing_dir"]
    assert loads["no_latest"] == ("ok", (None, None))
    kind, message = loads["missing_tag"]
    assert kind == "FileNotFoundError", loads["missing_tag"]
    assert os.path.join(root, "ckpt", "step99") in message
    assert "step2" in message and "step4" in message, f"the tags there are listed: {message}"


@pytest.mark.parametrize("case,words", [
    ("truncated", ["rank00001.safetensors"]),
    ("missing_file", ["rank00001.safetensors"]),
    ("corrupted", ["rank00001.safetensors", "optim/exp_avg/hidden.weight"]),
    ("version99", ["99", "version"]),
])
def test_damaged_checkpoint_is_named(bad_inputs, case, words):
    kind, message = bad_inputs["loads"][case]
    assert kind != "ok", f"{case}: loaded without an error"
    for word in words:
        assert word in message, f"{case}: the error does not name {word!r}: {kind}: {message}"
    if case == "corrupted":
        assert "crc" in message.lower() or "checksum" in message.lower(), message


def test_deepspeed_script_patterns(bad_inputs):
    loads, saves = bad_inputs["loads"], bad_inputs["saves"]
    got = loads["ds_pattern"]
    assert got["step"] == 2
    _assert_same_state(got["snap"], saves[0]["step2"], "step2")
    path, client = loads["latest"]["result"]
    assert path == os.path.join(bad_inputs["root"], "ckpt", "step4") and client == {"step": 4}
    _assert_same_state(loads["latest"]["snap"], saves[0]["step4"], "latest")
    # The frozen layer and every weight of the module come back too (saved at stage 3, world 2).
    assert W.equal_arrays(loads["latest"]["snap"]["module"], saves[0]["step4"]["module"])


def test_renamed_and_reshaped_parameters(bad_inputs):
    loads, saved = bad_inputs["loads"], bad_inputs["saves"][0]["step4"]["module"]
    kind, message = loads["strict"]
    assert kind == "ValueError", loads["strict"]
    for name in ("out.weight", "out.bias", "head.weight", "head.bias", "unused.weight", "unused.bias"):
        assert name in message, f"the error does not name {name}: {message}"
    r = loads["not_strict"]
    assert r["result"][0] == "ok", r["result"]
    warnings = [line for line in r["log"] if "load_module_strict=False" in line]
    assert len(warnings) == 1 and "head.weight" in warnings[0] and "unused.weight" in warnings[0], r["log"]
    for name in ("hidden.weight", "hidden.bias", "frozen.weight", "frozen.bias"):
        assert np.array_equal(r["after"][name], saved[name]), f"{name} was not loaded"
    for name in ("head.weight", "head.bias", "unused.weight", "unused.bias"):
        assert np.array_equal(r["after"][name], r["before"][name]), f"{name} was changed"


def test_load_optimizer_states_false_and_module_only(bad_inputs):
    loads, saved = bad_inputs["loads"], bad_inputs["saves"][0]["step4"]
    for key in ("no_optimizer", "module_only"):
        r = loads[key]
        assert r["result"][0] == "ok", (key, r["result"])
        before, after = r["before"], r["after"]
        assert W.equal_arrays(after["fp32"], saved["fp32"]), f"{key}: the weights were not loaded"
        assert W.equal_arrays(after["module"], saved["module"]), f"{key}: the module's weights"
        for s in after["states"]:
            assert W.equal_arrays(after["states"][s], before["states"][s]), f"{key}: {s} changed"
        assert after["group_steps"] == before["group_steps"] == [1], key
    assert loads["no_optimizer"]["result"][1][1] == {"step": 4}
    assert loads["no_optimizer"]["after"]["global_steps"] == 4  # the run's counters come from the checkpoint
    assert loads["module_only"]["after"]["global_steps"] == 1  # load_module_only: only the module
    assert loads["module_only"]["result"][1][1] == {"step": 4}


def test_checkpoint_of_another_optimizer(bad_inputs):
    """An SGD checkpoint into an AdamW run: an error naming both (whether or not the run has
    stepped), not Adam with SGD's lr and step count and no moments; the weights alone load."""
    loads, sgd = bad_inputs["loads"], bad_inputs["saves"][0]["sgd"]
    r = loads["other_optimizer"]
    assert r["result"][0] == "ValueError", \
        (f"loaded without an error: lr {r['before']['lr']} -> {r['after']['lr']}, Adam's step counts "
         f"{r['before']['group_steps']} -> {r['after']['group_steps']}, exp_avg "
         f"{'empty' if r['after']['states']['exp_avg'][0] is None else 'present'}")
    message = r["result"][1]
    assert "SGD" in message and "AdamW" in message and "load_optimizer_states=False" in message, message
    # Checked before anything is written: the run is as it was.
    assert W.equal_arrays(r["after"]["fp32"], r["before"]["fp32"])
    assert W.equal_arrays(r["after"]["states"], r["before"]["states"])
    assert r["after"]["lr"] == r["before"]["lr"] and r["after"]["group_steps"] == r["before"]["group_steps"]
    r = loads["other_optimizer_weights"]
    assert r["result"][0] == "ok", r["result"]
    assert W.equal_arrays(r["after"]["fp32"], sgd["fp32"])


def test_unsupported_load_options(bad_inputs):
    kind, message = bad_inputs["loads"]["custom_load_fn"]
    assert kind == "ValueError" and "custom_load_fn" in message
    kind, message = bad_inputs["loads"]["load_universal"]
    assert kind == "ValueError" and "checkpoint.load_universal" in message
