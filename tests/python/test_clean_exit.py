"""Ending a run. engine.destroy() (accelerate's free_memory) takes the engine's hooks off the model.
A run that ends cleanly exits 0: the process group zeroshard started is torn down at exit
(issue 25: Gloo's threads left running into exit() aborted clean runs with SIGABRT). The script
below does no clean-up of its own, as most training scripts do not; a probe registered before
zeroshard is imported runs after zeroshard's exit handler and reports what it left."""
import os
import subprocess
import sys
import textwrap

import torch

from harness import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 1000}

SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist
    # atexit runs handlers last-in first-out: this one runs after zeroshard's.
    atexit.register(lambda: print(f"EXIT-PROBE initialized={dist.is_initialized()}", flush=True))
    import torch
    import zeroshard
    model = torch.nn.Linear(4, 2)
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3}})
    for _ in range(2):
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
""")


def test_after_an_exception_the_group_is_left_alone_and_the_error_is_the_exit(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT + "raise KeyError('the script failed')\n")
    run = subprocess.run([sys.executable, "-m", "zeroshard.launcher.runner", "--num_gpus", "2",
                          str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "the script failed" in out, out[-3000:]
    assert "EXIT-PROBE initialized=True" in out, out[-3000:]  # not destroyed: nothing to wait on


def test_process_group_is_destroyed_at_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for attempt in range(2):  # the abort was intermittent: a few runs, each must exit 0
        run = subprocess.run([sys.executable, "-m", "zeroshard.launcher.runner", "--num_gpus", "2",
                              str(script)], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
        out = run.stdout + run.stderr
        assert run.returncode == 0, f"run {attempt} exited {run.returncode}:\n{out[-3000:]}"
        assert out.count("EXIT-PROBE initialized=False") == 2, out[-3000:]


def destroy_worker():
    import zeroshard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine, *_ = zeroshard.initialize(model=model, config={**BASE, "zero_optimization": {"stage": 3}})
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    engine.destroy()
    hooks_after = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    grad_hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    try:
        engine(torch.ones(2, 4))
        forward = None
    except RuntimeError as e:
        forward = str(e)
    return {"before": hooks_before, "after": hooks_after, "grad_hooks": grad_hooks, "forward": forward}


def test_destroy_removes_the_engines_hooks_and_refuses_to_train_on():
    got = run_distributed(destroy_worker, 2, timeout=120)
    for r in got:
        assert r["before"] > 0 and r["after"] == 0 and r["grad_hooks"] == 0, r
        assert "destroy() was called" in r["forward"], r["forward"]
