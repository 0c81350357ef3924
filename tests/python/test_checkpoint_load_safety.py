"""A load that fails, at world 2: every rank raises promptly with the failing rank's message (no
rank left waiting in another collective), and checks come before any write. Also the loads the
other files do not reach: stage 3 with persistent (whole) parameters, a checkpoint saved before
its first step into a run that has stepped, buffers that do not match, client_state tensors a
shard file cannot hold."""
import os
import time

import torch

import checkpoint_workers as W
from harness import run_distributed

STAGE3_PERSISTENT = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares the kind and the message
        return (type(e).__name__, str(e))


def save_worker(root, extra, steps, tag):
    engine = W.build("gpt", W.config(3, extra=extra))
    W.train(engine, "gpt", 0, steps)
    engine.save_checkpoint(root, tag=tag)
    return W.snapshot(engine)


def corrupt(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupted_load_worker(root):
    engine = W.build("gpt", W.config(3, extra=STAGE3_PERSISTENT))
    t0 = time.monotonic()
    result = _outcome(lambda: engine.load_checkpoint(root, tag="good"))
    return result, time.monotonic() - t0


def test_a_corrupted_file_on_one_rank_fails_every_rank_promptly(tmp_path):
    """Rank 1's file is corrupted at its end, so rank 1 fails while rank 0 reads fine: both raise
    the checksum error naming the file (rank 0 names rank 1), well inside the comm timeout, at
    stage 3 with persistent parameters (whose gather after a load is a collective)."""
    root = str(tmp_path)
    run_distributed(save_worker, 2, root, STAGE3_PERSISTENT, 2, "good")
    corrupt(os.path.join(root, "good", "rank00001.safetensors"))
    results = run_distributed(corrupted_load_worker, 2, root, timeout=120, env={"ZEROSHARD_TIMEOUT": "1.5"})
    for rank, ((kind, message), seconds) in enumerate(results):
        assert kind != "ok", f"rank {rank} loaded a corrupted checkpoint"
        assert "rank00001.safetensors" in message and "checksum" in message, f"rank {rank}: {message}"
        assert "partial load" in message, f"rank {rank}: {message}"
        assert seconds < 60, f"rank {rank} took {seconds:.0f} s: it waited in a collective"
    assert "rank 1 failed" in results[0][0][1], results[0][0][1]


def resume_worker(root, mode):
    """Stage 3 with persistent parameters (whole on every rank): 4 steps, or 2 + save + 2 after a
    load into an engine that had already trained on other data (so a stale gathered copy would show)."""
    engine = W.build("gpt", W.config(3, extra=STAGE3_PERSISTENT))
    if mode == "full":
        losses = W.train(engine, "gpt", 0, 4)
    elif mode == "first":
        losses = W.train(engine, "gpt", 0, 2)
        engine.save_checkpoint(root, tag="half")
    else:
        W.train(engine, "gpt", 7, 9)  # moves every weight, persistent ones included
        engine.load_checkpoint(root, tag="half")
        losses = W.train(engine, "gpt", 2, 4)
    return losses, W.snapshot(engine)


def test_stage3_persistent_parameters_resume_exactly(tmp_path):
    root = str(tmp_path)
    full = run_distributed(resume_worker, 2, root, "full")
    first = run_distributed(resume_worker, 2, root, "first")
    second = run_distributed(resume_worker, 2, root, "second")
    for rank in range(2):
        assert first[rank][0] + second[rank][0] == full[rank][0], f"rank {rank}: losses differ"
        assert W.equal_arrays(second[rank][1]["fp32"], full[rank][1]["fp32"])
        assert W.equal_arrays(second[rank][1]["module"], full[rank][1]["module"])


def before_first_step_worker(root, mode):
    """A checkpoint saved before any step, loaded into a run that has stepped: the run continues
    as a fresh one from that checkpoint (moments and Adam's step counts start again)."""
    engine = W.build("gpt", W.config(1))
    if mode == "save":
        engine.save_checkpoint(root, tag="start")
        return None
    if mode == "stepped":
        W.train(engine, "gpt", 5, 8)
        engine.load_checkpoint(root, tag="start")
    return W.train(engine, "gpt", 0, 3), W.snapshot(engine)


def test_a_checkpoint_from_before_the_first_step_resets_the_optimizer(tmp_path):
    root = str(tmp_path)
    run_distributed(before_first_step_worker, 2, root, "save")
    fresh = run_distributed(before_first_step_worker, 2, root, "fresh")
    loaded = run_distributed(before_first_step_worker, 2, root, "stepped")
    for rank in range(2):
        assert loaded[rank][0] == fresh[rank][0], f"rank {rank}: losses differ from a fresh run"
        assert W.equal_arrays(loaded[rank][1]["fp32"], fresh[rank][1]["fp32"])
        assert W.equal_arrays(loaded[rank][1]["states"], fresh[rank][1]["states"])


class WithBuffer(torch.nn.Module):
    def __init__(self, size):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("stats", torch.arange(float(size)))

    def forward(self, x):
        return self.lin(x).sum() + self.stats.sum() * 0


def buffer_worker(root, mode):
    engine = W.build_module(WithBuffer(3 if mode != "bigger" else 5), W.config(2))
    if mode == "save":
        engine.save_checkpoint(root, tag="b")
        return None
    before = engine.module.stats.clone()
    result = _outcome(lambda: engine.load_checkpoint(root, tag="b"))
    return result, bool(torch.equal(engine.module.stats, before))


def test_buffers_are_checked_like_parameters(tmp_path):
    root = str(tmp_path)
    run_distributed(buffer_worker, 2, root, "save")
    (kind, message), unchanged = run_distributed(buffer_worker, 2, root, "bigger")[0]
    assert kind == "ValueError" and "stats" in message and "[3]" in message and "[5]" in message, message
    assert unchanged


def client_worker(root):
    engine = W.build("gpt", W.config(0))
    return _outcome(lambda: engine.save_checkpoint(root, client_state={"x": torch.zeros(2, dtype=torch.complex128)}))


def test_client_state_tensor_a_file_cannot_hold_is_named(tmp_path):
    kind, message = run_distributed(client_worker, 2, str(tmp_path))[0]
    assert kind == "TypeError" and "client_state['x']" in message and "complex128" in message, message
    assert not any(e.startswith(".tmp") for e in os.listdir(tmp_path))


def frozen_worker(root, mode):
    """mode "save": the GPT trained 1 step with its first parameter frozen, then saved; "load": the
    whole GPT, trained 1 step, loads it with its optimizer state."""
    from models import MODELS
    model = MODELS["gpt"]()
    first_name, first = next(iter(model.named_parameters()))
    first.requires_grad_(mode != "save")
    engine = W.build_module(model, W.config(1))
    W.train(engine, "gpt", 0, 1)
    if mode == "save":
        engine.save_checkpoint(root, tag="f")
        return first_name
    before = {n: t.clone() for n, t in engine.module.state_dict().items()}
    result = _outcome(lambda: engine.load_checkpoint(root, tag="f"))
    return result, all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items())


def test_a_parameter_trained_here_but_frozen_in_the_checkpoint_is_refused_before_any_write(tmp_path):
    """Its optimizer state was never saved: the load names it and writes nothing, instead of
    failing part-way through."""
    root = str(tmp_path)
    name = run_distributed(frozen_worker, 2, root, "save")[0]
    for (kind, message), unchanged in run_distributed(frozen_worker, 2, root, "load"):
        assert kind == "ValueError" and f"no optimizer state for {name}, which this run trains" in message, message
        assert "load_optimizer_states=False" in message and unchanged


def moved_group_worker(root, mode):
    """mode "save": the GPT with two param groups (matrices with weight decay, the rest without),
    trained 1 step and saved; "load": the first matrix in the second group instead."""
    import zeroshard
    from models import MODELS
    model = MODELS["gpt"]()
    named = list(model.named_parameters())
    matrices, rest = [p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]
    if mode == "load":
        matrices, rest = matrices[1:], [matrices[0]] + rest
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups, config=W.config(2))
    W.train(engine, "gpt", 0, 1)
    if mode == "save":
        engine.save_checkpoint(root, tag="g")
        return next(n for n, p in named if p.dim() >= 2)
    before = {n: t.clone() for n, t in engine.module.state_dict().items()}
    result = _outcome(lambda: engine.load_checkpoint(root, tag="g"))
    return result, all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items())


def test_a_parameter_moved_to_another_param_group_is_refused(tmp_path):
    """Group hyper-parameters load by index: the moved matrix would get the other group's weight
    decay. Refused before any write, naming it."""
    root = str(tmp_path)
    name = run_distributed(moved_group_worker, 2, root, "save")[0]
    for (kind, message), unchanged in run_distributed(moved_group_worker, 2, root, "load"):
        assert kind == "ValueError" and f"{name} (checkpoint 0, this run 1)" in message, message
        assert unchanged
