"""No silent hangs, end to end: a ZeRO run where rank 1 skips a block in forward (so its gradient
buckets differ from rank 0's) ends on every rank in a CommError naming each rank's collective and
sequence number, within the timeout: at once with ZEROSHARD_DEBUG_COLLECTIVES=1 (the agreement
check), and within ZEROSHARD_TIMEOUT without it. A rank that dies before a collective is named by
its last collective on the rank that survives."""
import os
import re
import time

import pytest
import torch
import torch.nn as nn

from harness import run_distributed, run_tolerating_deaths

ENGINE_TIMEOUT_S = 6.0  # ZEROSHARD_TIMEOUT=0.1 minutes
# After the timeout: up to 3 s for the other ranks' reports, the store reads, slack for a busy box.
MARGIN_S = 8.0
HARNESS_TIMEOUT_S = 90  # must exceed the engine's timeout


class SkippableBlocks(nn.Module):
    """Four blocks and a head; forward(x, skip=True) leaves out block 1, so that block's
    parameters get no gradient on this rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x, skip=False):
        for i, block in enumerate(self.blocks):
            if skip and i == 1:
                continue
            x = torch.tanh(block(x))
        return self.head(x).pow(2).mean()


def _engine(stage):
    import zeroshard
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000,
           # Small buckets: one or two blocks each, so a skipped block changes the bucket sequence.
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}
    engine, *_ = zeroshard.initialize(model=SkippableBlocks(), config=cfg)
    return engine


def _batch(step):
    return torch.randn(2, 16, generator=torch.Generator().manual_seed(step))


def desync_worker(stage, steps, stderr_prefix=None):
    """Trains `steps` steps with rank 1 skipping block 1; returns the error each rank ended with.
    With stderr_prefix, the rank's stderr goes to <stderr_prefix>.<rank> (read after a rank died)."""
    from zeroshard import _C
    rank = int(os.environ["RANK"])
    if stderr_prefix:
        os.dup2(os.open(f"{stderr_prefix}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    engine = _engine(stage)
    start = time.monotonic()
    try:
        for step in range(steps):
            loss = engine(_batch(step), skip=(rank == 1))
            engine.backward(loss)
            engine.step()
    except RuntimeError as e:
        return {"error": str(e), "comm_error": isinstance(e, _C.CommError),
                "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _names_every_rank(message, world):
    """Every rank appears with a sequence number and a collective, e.g. 'rank 1 is in #7 all_reduce('."""
    for r in range(world):
        pattern = rf"rank[s]? [0-9,\-]*\b{r}\b[0-9,\-]* (is in|are in|last started) #\d+ \w+\("
        if not re.search(pattern, message):
            return False
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_debug_mode_reports_the_mismatch_on_every_rank(stage):
    out = run_distributed(desync_worker, 2, stage, 3, timeout=HARNESS_TIMEOUT_S,
                          env={"ZEROSHARD_DEBUG_COLLECTIVES": "1"})
    mismatch = []
    for rank, o in enumerate(out):
        assert o["error"] is not None, f"rank {rank} trained through the mismatch"
        assert o["comm_error"], o["error"]
        m = re.match(r"collective mismatch at #(\d+): rank 0 (\w+\(.*?\)), rank 1 (\w+\(.*?\)) \(seen by rank",
                     o["error"])
        assert m, o["error"]
        assert m.group(2) != m.group(3)
        mismatch.append(m.groups())
        # Caught before the collective is issued: no waiting on a timeout.
        assert o["elapsed"] < ENGINE_TIMEOUT_S, o
    assert mismatch[0] == mismatch[1]  # both ranks name the same collectives


@pytest.mark.parametrize("stage", [1, 2])
def test_without_debug_every_rank_ends_within_the_timeout_naming_every_rank(stage, tmp_path):
    """Without the check the buckets' sizes differ, and Gloo itself may notice first: its I/O
    thread then throws on the receiving rank ("Received data size doesn't match expected size"),
    which ends that process in std::terminate, where no caller can catch it. zeroshard's
    terminate handler still reports that rank's collective to the others and prints the
    all-rank message on its stderr before the abort. Every rank that survives raises the error,
    naming both ranks' sequence numbers and collectives."""
    env = {"ZEROSHARD_TIMEOUT": str(ENGINE_TIMEOUT_S / 60), "OMP_NUM_THREADS": "1"}
    prefix = str(tmp_path / "stderr")
    got, exitcodes = run_tolerating_deaths(desync_worker, 2, stage, 3, prefix,
                                            timeout=HARNESS_TIMEOUT_S, env=env)
    # Each rank either raised the error or was ended by Gloo and printed it; sometimes both ranks
    # receive a wrong size, and both are ended.
    for rank in range(2):
        if rank not in got:
            assert exitcodes[rank] == -6, f"rank {rank} neither reported nor was killed by Gloo: {exitcodes}"
            with open(f"{prefix}.{rank}") as f:
                stderr = f.read()
            fatal = [line for line in stderr.splitlines() if line.startswith(f"[zeroshard] rank {rank}: fatal: ")]
            assert fatal, stderr[-3000:]
            assert re.search(rf"collective failed on rank {rank} in #\d+ \w+\(", fatal[0]), fatal[0]
            assert _names_every_rank(fatal[0], 2), fatal[0]
            assert "the backend ended this process from its own thread" in fatal[0], fatal[0]
            assert "ZEROSHARD_DEBUG_COLLECTIVES=1" in fatal[0], fatal[0]
            continue
        status, o = got[rank]
        assert status == "ok", o
        assert o["error"] is not None, f"rank {rank} trained through the mismatch"
        assert o["comm_error"], o["error"]
        assert re.match(r"collective (timeout after 6 s|failed|aborted) on rank \d in #\d+ \w+\(",
                        o["error"]), o["error"]
        assert _names_every_rank(o["error"], 2), o["error"]
        assert o["elapsed"] < ENGINE_TIMEOUT_S + MARGIN_S, o


def dying_worker(steps_before_death):
    """Rank 1 trains a few steps, then dies between forward and backward (before the bucket
    reductions); rank 0 carries on into them."""
    from zeroshard import _C
    rank = int(os.environ["RANK"])
    engine = _engine(2)
    start = time.monotonic()
    try:
        for step in range(steps_before_death + 2):
            loss = engine(_batch(step))
            if rank == 1 and step == steps_before_death:
                os._exit(1)
            start = time.monotonic()
            engine.backward(loss)
            engine.step()
    except RuntimeError as e:
        return {"error": str(e), "comm_error": isinstance(e, _C.CommError),
                "elapsed": time.monotonic() - start, "recent": engine._comm.recent_collectives()}
    return {"error": None}


def test_a_dead_rank_is_named_by_its_last_collective():
    env = {"ZEROSHARD_TIMEOUT": str(ENGINE_TIMEOUT_S / 60), "OMP_NUM_THREADS": "1"}
    got, exitcodes = run_tolerating_deaths(dying_worker, 2, 2, timeout=HARNESS_TIMEOUT_S, env=env)
    assert exitcodes[1] == 1
    assert 0 in got and got[0][0] == "ok", got
    out = got[0][1]
    assert out["error"] is not None and out["comm_error"], out
    assert out["elapsed"] < ENGINE_TIMEOUT_S + MARGIN_S, out
    msg = out["error"]
    assert re.match(r"collective (timeout after 6 s|failed) on rank 0 in #\d+ \w+\(", msg), msg
    assert re.search(r"rank 0 is in #\d+ \w+\(", msg), msg
    m = re.search(r"rank 1 last started #(\d+) (\w+\(.*?\)) \(no report: dead\?\)", msg)
    assert m, msg
    # Rank 1's last collective is one rank 0 also completed: it is in rank 0's flight recorder.
    assert f"#{m.group(1)} {m.group(2)} done" in out["recent"], (msg, out["recent"])
