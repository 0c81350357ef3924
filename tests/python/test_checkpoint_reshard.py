"""A checkpoint loads at any world size, ZeRO stage and precision (zeroshard/checkpoint/load.py):
the reshard matrix of issue 18 against the single-process torch.optim reference (the numerics
contract, fp32: 1e-5 relative per tensor), 16-bit <-> fp32 through the fp32 masters (the loss
scaler only between fp16 runs), buffers as rank 0 had them, and the DeepSpeed ZeRO checkpoints in
tests/fixtures/deepspeed (and one re-saved as fp16) loaded by engine.load_checkpoint."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import checkpoint_workers as W
from harness import run_distributed
from models import global_batch, tiny_gpt

GLOBAL_BATCH = 12  # the same global batch at every world size: micro = 12 / world
SAVE_AT, END = 3, 6
TOL = 1e-5
# Adam's moments are not in the contract: they are sums of gradients (and squares) whose fp32
# summation order differs with the world size, about 1e-6 relative per step, squared in exp_avg_sq.
MOMENT_TOL = 1e-4


# ----- the reshard matrix -----------------------------------------------------------------------------

def _cfg(world, stage, precision="fp32"):
    return W.config(stage, precision, micro=GLOBAL_BATCH // world, train_batch=GLOBAL_BATCH)


def save_worker(root, runs):
    """runs: [(name, stage, precision)]; each trains SAVE_AT steps and saves to root/name."""
    world = W.rank_and_world()[1]
    out = {}
    for name, stage, precision in runs:
        engine = W.build("gpt", _cfg(world, stage, precision))
        losses = W.train(engine, "gpt", 0, SAVE_AT)
        engine.save_checkpoint(os.path.join(root, name), tag="ck", client_state={"run": name})
        out[name] = {"losses": losses, "snap": W.snapshot(engine)}
    return out


def load_worker(root, loads):
    """loads: [(checkpoint name, stage, precision, continue training)]; a failed load is returned as
    its error (load errors reach every rank together), and the next one goes on."""
    world = W.rank_and_world()[1]
    out = []
    for name, stage, precision, cont in loads:
        engine = W.build("gpt", _cfg(world, stage, precision))
        scale_before = engine.get_loss_scale()
        try:
            path, client = engine.load_checkpoint(os.path.join(root, name))
        except Exception as e:  # noqa: BLE001 - the test reports it
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        result = {"path": path, "client": client, "loaded": W.snapshot(engine), "scale_before": scale_before}
        if cont:
            result["losses"] = W.train(engine, "gpt", SAVE_AT, END)
            result["end"] = W.snapshot(engine, module_weights=False)
        out.append(result)
    return out


def reference_run():
    """torch.optim.AdamW on one process over the same global batches: losses, and parameters and
    moments by name after SAVE_AT and END steps."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    names = [n for n, _ in model.named_parameters()]
    losses, states = [], {}
    for step in range(END):
        opt.zero_grad()
        loss = model(global_batch("gpt", step, GLOBAL_BATCH))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step + 1 in (SAVE_AT, END):
            params = dict(model.named_parameters())
            states[step + 1] = {
                "fp32": {n: params[n].detach().numpy().copy() for n in names},
                "exp_avg": {n: opt.state[params[n]]["exp_avg"].numpy().copy() for n in names},
                "exp_avg_sq": {n: opt.state[params[n]]["exp_avg_sq"].numpy().copy() for n in names},
            }
    return losses, states


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def _close(got, want, what, tol=TOL):
    err = float(np.abs(got.reshape(want.shape) - want).max())
    scale = float(np.abs(want).max())
    assert err <= tol * scale, f"{what}: differs by {err:.3e} (scale {scale:.3e})"


def _assert_matches_reference(snap, ref, what):
    for i, name in enumerate(snap["names"]):
        _close(snap["fp32"][i], ref["fp32"][name], f"{what}: fp32 {name}")
        for s in ("exp_avg", "exp_avg_sq"):
            _close(snap["states"][s][i], ref[s][name], f"{what}: {s} of {name}", MOMENT_TOL)


def _assert_bit_equal(got, want, what, kinds=("fp32", "exp_avg", "exp_avg_sq")):
    assert got["names"] == want["names"]
    for i, name in enumerate(want["names"]):
        for kind in kinds:
            a = got["fp32"][i] if kind == "fp32" else got["states"][kind][i]
            b = want["fp32"][i] if kind == "fp32" else want["states"][kind][i]
            assert W.equal_arrays([a], [b]), f"{what}: {kind} of {name} is not the saved value"


def _reshard_lines(out):
    return [line for line in out.splitlines() if "load_checkpoint: resharded" in line]


# name -> (world, stage, precision) of the runs that save, SAVE_AT steps into training
SAVES = {"w2s3": (2, 3, "fp32"), "w2s2-bf16": (2, 2, "bf16"), "w2s2-fp16": (2, 2, "fp16"), "w4s1": (4, 1, "fp32")}


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    saved = {}
    for world in sorted({w for w, _, _ in SAVES.values()}):
        runs = [(name, stage, precision) for name, (w, stage, precision) in SAVES.items() if w == world]
        for r in run_distributed(save_worker, world, root, runs, timeout=240):
            for name, value in r.items():
                saved.setdefault(name, []).append(value)
    return root, saved


def _notice(name, world, stage, precision):
    saved_world, saved_stage, saved_precision = SAVES[name]
    return (f"[zeroshard] load_checkpoint: resharded a zeroshard checkpoint saved at world {saved_world}, ZeRO "
            f"stage {saved_stage}, {saved_precision} to world {world}, stage {stage}, {precision}")


# (checkpoint, world, stage): the matrix of issue 18, each trained on after the load.
MATRIX = [("w2s3", 1, 0), ("w2s3", 3, 1), ("w2s3", 4, 2), ("w4s1", 2, 3)]


def test_reshard_matrix(saved_runs, capfd, reference):
    ref_losses, ref_states = reference
    root, saved = saved_runs
    capfd.readouterr()
    # What was saved is the reference's state after SAVE_AT steps (so a load is checked against it).
    for name in ("w2s3", "w4s1"):
        for rank, s in enumerate(saved[name]):
            _assert_matches_reference(s["snap"], ref_states[SAVE_AT], f"{name} rank {rank} at save")
    for name, world, stage in MATRIX:
        results = run_distributed(load_worker, world, root, [(name, stage, "fp32", True)], timeout=240)
        what = f"{name} -> world {world} stage {stage}"
        lines = _reshard_lines(capfd.readouterr().out)
        assert lines == [_notice(name, world, stage, "fp32")], f"{what}: the reshard notice, once from rank 0: {lines}"
        for rank, r in enumerate(results):
            (r,) = r
            assert "error" not in r, f"{what}, rank {rank}: {r.get('error')}"
            assert r["path"] == os.path.join(root, name, "ck") and r["client"] == {"run": name}
            # Every element moved to its new owner unchanged, then training continues as the reference.
            _assert_bit_equal(r["loaded"], saved[name][0]["snap"], f"{what} rank {rank}, after load")
            assert (r["loaded"]["global_steps"], r["loaded"]["global_samples"], r["loaded"]["group_steps"]) == \
                (SAVE_AT, SAVE_AT * GLOBAL_BATCH, [SAVE_AT]), what
            _assert_matches_reference(r["end"], ref_states[END], f"{what} rank {rank}, {END} steps")
        losses = np.mean([r[0]["losses"] for r in results], axis=0)
        for step, (got, want) in enumerate(zip(losses, ref_losses[SAVE_AT:]), SAVE_AT):
            assert abs(got - want) <= TOL * abs(want), f"{what}: step {step} loss {got!r} vs reference {want!r}"


# (checkpoint, stage, precision) loaded at world 3: the fp32 side is always the fp32 masters.
PRECISION_CHANGES = [("w2s2-bf16", 1, "fp32"), ("w2s3", 2, "bf16"), ("w2s2-fp16", 1, "fp32"), ("w2s2-fp16", 3, "bf16"),
                     ("w2s3", 0, "fp16")]
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_precision_changes_through_the_fp32_masters(saved_runs, capfd):
    """16-bit -> fp32: the fp32 weights are the saved masters, not the 16-bit copies widened; fp32 ->
    16-bit: the masters are the fp32 weights and the model's copy is them rounded. The loss scaler
    belongs to fp16: a checkpoint of another precision leaves the run's own (initial) scale, and an
    fp16 checkpoint's scale does not stop a run of another precision from loading."""
    root, saved = saved_runs
    capfd.readouterr()
    results = run_distributed(load_worker, 3, root, [(n, s, p, False) for n, s, p in PRECISION_CHANGES])
    lines = _reshard_lines(capfd.readouterr().out)
    problems = []
    for rank, per_load in enumerate(results):
        for (name, stage, precision), r in zip(PRECISION_CHANGES, per_load):
            what = f"rank {rank}: {name} -> world 3, stage {stage}, {precision}"
            if "error" in r:
                problems.append(f"{what}: {r['error']}")
                continue
            want = saved[name][0]["snap"]
            _assert_bit_equal(r["loaded"], want, what)
            for i, pname in enumerate(want["names"]):
                rounded = torch.from_numpy(want["fp32"][i]).to(_TORCH[precision]).float().numpy()
                assert W.equal_arrays([r["loaded"]["module"][pname]], [rounded]), \
                    f"{what}: the model's {pname} is not the saved fp32 master in {precision}"
            if precision == "fp16" and SAVES[name][2] != "fp16":
                if r["loaded"]["loss_scale"] != r["scale_before"]:
                    problems.append(f"{what}: the loss scale became {r['loaded']['loss_scale']} (the {SAVES[name][2]} "
                                    f"run's), not this fp16 run's own {r['scale_before']}")
            if rank == 0 and _notice(name, 3, stage, precision) not in lines:
                problems.append(f"{what}: no reshard notice")
    assert not problems, "\n".join(problems)


# ----- DeepSpeed ZeRO checkpoints, loaded by engine.load_checkpoint ----------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
DS_LR, DS_BETAS = 1e-2, (0.9, 0.99)
sys.path.insert(0, FIXTURES)
from make_fixture import TinyModel, param_group_names, param_groups  # noqa: E402 - the fixture's own model


def _ds_groups(model):
    """make_fixture.py's two groups: weight decay on matrices, none on the rest."""
    return param_groups(model, param_group_names(model))


def _ds_batch(world):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 50, (4 * world, 6), generator=g), torch.randn(4 * world, 6, 7, generator=g)


# fixture -> the zeroshard stage it is loaded at, at world 1 and at world 2 (saved at world 2); one
# by its `latest` file (tag=None), the others by tag="step3"
DS_LOADS = {
    1: {"zero1_fp32": 0, "zero2_fp32": 3, "zero3_fp32": 1, "zero3_bf16": 2},
    2: {"zero1_fp32": 3, "zero2_fp32": 1, "zero3_fp32": 2, "zero3_bf16": 0, "zero1_bf16": 3},
}
BY_LATEST = (2, "zero3_bf16")


def ds_import_worker(loads):
    import zeroshard
    rank, world = W.rank_and_world()
    out = {}
    for case, stage in loads.items():
        try:
            torch.manual_seed(123)  # weights unlike the checkpoint's, so a missed load shows
            model = TinyModel()
            with torch.no_grad():  # the frozen parameter and the buffer too
                model.scale.mul_(2.0)
                model.shift.add_(1.0)
            optimizer = torch.optim.AdamW(_ds_groups(model), lr=DS_LR, betas=DS_BETAS, eps=1e-8)
            cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": DS_LR,
                                                                "warmup_num_steps": 5}},
                   "steps_per_print": 1000}
            if stage == 3:
                cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            if case.endswith("bf16"):
                cfg["bf16"] = {"enabled": True}
            engine, _, _, scheduler = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
            tag = None if (world, case) == BY_LATEST else "step3"
            path, client = engine.load_checkpoint(os.path.join(FIXTURES, case), tag=tag)
            r = {"path": path, "client": client, "snap": W.snapshot(engine),
                 "scheduler": scheduler.state_dict(),
                 "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]}
            # One more step on a known global batch: Adam continues from step 3's moments and count.
            tokens, target = _ds_batch(world)
            mine = slice(4 * rank, 4 * rank + 4)
            loss = torch.nn.functional.mse_loss(engine(tokens[mine]).float(), target[mine])
            engine.backward(loss)
            engine.step()
            r["after_step"] = W.snapshot(engine, module_weights=False)
            out[case] = r
        except Exception:  # noqa: BLE001 - the case's test reports it
            import traceback
            out[case] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def ds_loaded():
    results = {}
    for world, loads in DS_LOADS.items():
        for rank, r in enumerate(run_distributed(ds_import_worker, world, loads, timeout=240)):
            for case, value in r.items():
                results.setdefault((world, case), []).append(value)
    return results


def _reference_step(expected, info, world):
    """torch.optim.AdamW continuing from DeepSpeed's state (masters, moments, step 3) one step on
    _ds_batch: the fp32 weights after it, by name."""
    model = TinyModel()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected[f"master/{name}"] if p.requires_grad else expected[f"param/{name}"].float())
        model.shift.copy_(expected["buffer/shift"].float())
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in g["params"]], "weight_decay": g["weight_decay"], "lr": g["lr"]}
              for g in info["param_groups"]]
    opt = torch.optim.AdamW(groups, lr=DS_LR, betas=DS_BETAS, eps=1e-8)
    for name, p in params.items():
        if p.requires_grad:
            opt.state[p] = {"step": torch.tensor(float(info["optimizer_step"])),
                            "exp_avg": expected[f"optim/exp_avg/{name}"].clone(),
                            "exp_avg_sq": expected[f"optim/exp_avg_sq/{name}"].clone()}
    tokens, target = _ds_batch(world)
    torch.nn.functional.mse_loss(model(tokens), target).backward()
    opt.step()
    return {n: p.detach().numpy() for n, p in params.items()}


@pytest.mark.parametrize("world,case", [(w, c) for w, loads in DS_LOADS.items() for c in loads])
def test_load_deepspeed_checkpoint(world, case, ds_loaded):
    from safetensors.torch import load_file
    expected = load_file(os.path.join(FIXTURES, case, "expected.safetensors"))
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        info = json.load(f)
    stage = DS_LOADS[world][case]
    what = f"{case} loaded at world {world}, stage {stage}"
    for rank, r in enumerate(ds_loaded[(world, case)]):
        assert "error" not in r, f"{what}, rank {rank}: {r.get('error')}"
        snap = r["snap"]
        assert r["path"] == os.path.join(FIXTURES, case, "step3")
        assert r["client"] == info["client_state"], what
        for key in ("global_steps", "global_samples", "skipped_steps"):
            assert snap[key] == info[key], f"{what}: {key} {snap[key]} != DeepSpeed's {info[key]}"
        assert snap["group_steps"] == [info["optimizer_step"]] * 2, f"{what}: Adam's step counts {snap['group_steps']}"
        assert snap["loss_scale"] == 1.0
        assert r["scheduler"] == info["lr_scheduler"], what
        assert snap["lr"] == [g["lr"] for g in info["param_groups"]], what
        assert [g["weight_decay"] for g in r["groups"]] == [0.1, 0.0]
        for i, name in enumerate(snap["names"]):
            assert np.array_equal(snap["fp32"][i], expected[f"master/{name}"].numpy()), f"{what}: master {name}"
            for s in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(snap["states"][s][i], expected[f"optim/{s}/{name}"].numpy()), \
                    f"{what}: {s} of {name}"
        # The module: its weights (16-bit ones as DeepSpeed had them), the frozen scale and the buffer.
        dtype = torch.bfloat16 if info["dtype"] == "bf16" else torch.float32
        assert sorted(snap["module"]) == sorted(info["param_names"] + info["buffer_names"])
        for key, got in snap["module"].items():
            want = expected[f"buffer/{key}"] if key in info["buffer_names"] else expected[f"param/{key}"]
            assert np.array_equal(got, want.to(dtype).float().numpy()), f"{what}: module {key}"
        # One step on from there is torch.optim's next step (fp32: the numerics contract).
        if info["dtype"] == "fp32":
            ref = _reference_step(expected, info, world)
            after = r["after_step"]
            for i, name in enumerate(after["names"]):
                want = ref[name]
                err = float(np.abs(after["fp32"][i].reshape(want.shape) - want).max())
                assert err <= TOL * float(np.abs(want).max()), f"{what}: {name} one step after the load: {err:.3e}"


def fp16_ds_worker(load_dir):
    import zeroshard
    torch.manual_seed(123)
    model = TinyModel()
    optimizer = torch.optim.AdamW(_ds_groups(model), lr=DS_LR, betas=DS_BETAS, eps=1e-8)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
           "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 2, "loss_scale_window": 1000}}
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
    engine.load_checkpoint(load_dir, tag="step3")
    return {"scaler": engine._core.state.state_dict()["loss_scaler"], "snap": W.snapshot(engine)}


def test_load_deepspeed_fp16_loss_scaler(tmp_path):
    """An fp16 DeepSpeed checkpoint's DynamicLossScaler carries on: DeepSpeed doubles the scale when
    (cur_iter - last_overflow_iter) % scale_window == 0 before cur_iter += 1, so the clean steps
    since the last overflow are cur_iter - last_overflow_iter - 1. No fixture is fp16 (DeepSpeed's
    CPU accelerator refuses it), so zero2_fp32 is re-saved as an fp16 run would have written it:
    16-bit module, and a scaler whose last overflow was at iteration 0 (the first step's, as often)."""
    from test_deepspeed_import import pickled_under_deepspeeds_names
    from zeroshard.checkpoint_import.deepspeed import DynamicLossScaler, load_file
    from safetensors.torch import load_file as load_safetensors
    step3 = tmp_path / "step3"
    shutil.copytree(os.path.join(FIXTURES, "zero2_fp32", "step3"), step3)
    scaler = DynamicLossScaler()
    # Overflow at iteration 0 took one hysteresis (2 -> 1) and kept the scale; iterations 1, 2 clean.
    scaler.__dict__.update(cur_scale=65536.0, cur_iter=3, last_overflow_iter=0, scale_factor=2.0, scale_window=1000,
                           min_scale=1.0, delayed_shift=2, cur_hysteresis=1, consecutive_hysteresis=False,
                           raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    with pickled_under_deepspeeds_names():
        for name in ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]:
            victim = step3 / name
            state = load_file(str(victim))
            if "module" in state:
                state["module"] = {k: v.half() if v.is_floating_point() else v for k, v in state["module"].items()}
            else:
                state["optimizer_state_dict"].update(loss_scaler=scaler, dynamic_loss_scale=True)
            torch.save(state, f"{victim}.new")  # not in place: `state` maps the old file's pages
            os.replace(f"{victim}.new", victim)
    (r,) = run_distributed(fp16_ds_worker, 1, str(tmp_path))
    assert r["scaler"] == {"scale": 65536.0, "steps_since_overflow": 2, "hysteresis_left": 1}, r["scaler"]
    expected = load_safetensors(os.path.join(FIXTURES, "zero2_fp32", "expected.safetensors"))
    for i, name in enumerate(r["snap"]["names"]):
        assert np.array_equal(r["snap"]["fp32"][i], expected[f"master/{name}"].numpy()), name
        assert np.array_equal(r["snap"]["module"][name], expected[f"param/{name}"].half().float().numpy()), name


# ----- buffers: one copy, rank 0's (as DeepSpeed saves the module's state_dict from rank 0) ----------

class Normed(torch.nn.Module):
    """BatchNorm without SyncBN: each rank's running statistics follow its own micro-batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(10, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, batch):
        return self.bn(self.fc(batch)).pow(2).mean()


def buffers_save_worker(root):
    engine = W.build_module(Normed(), W.config(1))
    W.train(engine, "awkward", 0, 3)
    engine.save_checkpoint(root)
    return W.module_state(engine)


def buffers_load_worker(root):
    engine = W.build_module(Normed(), W.config(3))
    engine.load_checkpoint(root)
    return W.module_state(engine)


def test_buffers_that_differ_across_ranks(tmp_path):
    saved = run_distributed(buffers_save_worker, 2, str(tmp_path))
    assert not np.array_equal(saved[0]["bn.running_mean"], saved[1]["bn.running_mean"])  # the premise
    loaded = run_distributed(buffers_load_worker, 3, str(tmp_path))
    for rank, got in enumerate(loaded):
        for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            assert np.array_equal(got[name], saved[0][name]), \
                (f"rank {rank}: {name} is not rank 0's saved buffer (rank 1's: "
                 f"{np.array_equal(got[name], saved[1][name])}): {got[name]} vs rank 0 {saved[0][name]}, "
                 f"rank 1 {saved[1][name]}")


def ds_weights_only_worker(load_dir, **load_kwargs):
    """A DeepSpeed bf16 ZeRO checkpoint loaded (load_kwargs): each parameter's fp32 master
    (safe_get_full_fp32_param) and its loaded bf16 weight."""
    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param
    torch.manual_seed(123)
    model = TinyModel()
    optimizer = torch.optim.AdamW(_ds_groups(model), lr=DS_LR, betas=DS_BETAS, eps=1e-8)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
           "bf16": {"enabled": True}}
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
    engine.load_checkpoint(load_dir, tag="step3", **load_kwargs)
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = (safe_get_full_fp32_param(p).numpy().copy(), p.detach().float().numpy().copy())
    return out


def test_without_its_optimizer_state_a_deepspeed_checkpoint_s_masters_are_its_weights():
    """As DeepSpeed loads one (load_optimizer_states=False rebuilds the fp32 masters from the 16-bit
    weights), not its saved fp32 masters, which differ from the weights by bf16's rounding."""
    from safetensors.torch import load_file
    expected = load_file(os.path.join(FIXTURES, "zero1_bf16", "expected.safetensors"))
    result, = run_distributed(ds_weights_only_worker, 1, os.path.join(FIXTURES, "zero1_bf16"),
                              load_optimizer_states=False, timeout=120)
    differ = 0
    for name, (master, weight) in result.items():
        assert np.array_equal(master, weight), name
        assert np.array_equal(weight, expected[f"param/{name}"].float().numpy()), name
        differ += not np.array_equal(master, expected[f"master/{name}"].numpy())
    assert differ > 0  # the saved masters are not what was loaded



def ds_moved_group_worker(stage):
    """The zero2_fp32 checkpoint (groups: matrices with weight decay, the rest without) loaded with
    its optimizer state into a run whose first matrix sits in the second group."""
    import zeroshard
    model = TinyModel()
    decay, rest = param_group_names(model)
    optimizer = torch.optim.AdamW(param_groups(model, [decay[1:], [decay[0]] + rest]), lr=DS_LR)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
    before = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(os.path.join(FIXTURES, "zero2_fp32"), tag="step3")
    except ValueError as error:
        return str(error), all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items()), decay[0]
    return None, None, decay[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_in_another_param_group_than_saved_is_refused(stage):
    """Each group's hyper-parameters (weight decay here) load by group index, so a parameter moved
    to another group would get the other group's: refused before anything is written, naming it."""
    error, unchanged, moved = run_distributed(ds_moved_group_worker, 1, stage, timeout=120)[0]
    assert error is not None and f"{moved} (checkpoint 0, this run 1)" in error, error
    assert "build the optimizer's groups as the saved run did" in error and unchanged
