"""Faults during engine.save_checkpoint (python/zeroshard/checkpoint/save.py on the storage layer of
runtime/checkpoint/atomic_dir.h), with real processes: every rank SIGKILLed at random moments inside
a save, and a disk that fills up during a save. Afterwards `latest` must load, with the weights and
optimizer state of exactly one complete save, and nothing of the interrupted save may be left."""
import hashlib
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LEFTOVER_PREFIXES = (".tmp-", ".aside-")  # what an interrupted save leaves (atomic_dir.h)


# ----- run in every rank's process ---------------------------------------------------------------

def _engine(stage, d_model, n_layers):
    import zeroshard
    from gpt import GPT
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=16, d_model=d_model, n_layers=n_layers, n_heads=4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train_step(engine, step):
    rank, world = engine.global_rank, engine.world_size
    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, 256, (2 * world, 17), generator=g)[2 * rank: 2 * rank + 2]
    loss = engine(batch)
    engine.backward(loss)
    engine.step()


def _digest(engine):
    """SHA-256 of every parameter's whole fp32 value and Adam moments, in the core's order: the same
    at any world size and stage. Every rank must call it (the values are gathered)."""
    core = engine._core
    h = hashlib.sha256()
    for i in range(core.num_params):
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            value = core.full_values.get(i, kind)
            h.update(kind.encode())
            if value is not None:
                h.update(value.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _leftovers(save_dir):
    return sorted(e for e in os.listdir(save_dir) if e.startswith(LEFTOVER_PREFIXES))


def _say(rank, *words):
    if rank == 0:
        print(*words, flush=True)


def _record(path, step, digest):
    """Appends step -> digest to the side file, durably, before the save of that step begins."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "digest": digest}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _kill_worker(save_dir, record_path, stage, tag_mode, load, max_saves, d_model, n_layers):
    """Loads `latest` (when asked) and reports what it holds, saves once (the complete save A, which
    must also clean what the previous job's kill left), then trains and saves until it is killed.
    Rank 0 reports each event on stdout; the test reads it."""
    torch.set_num_threads(1)
    engine = _engine(stage, d_model, n_layers)
    rank = engine.global_rank
    if load:
        path, client = engine.load_checkpoint(save_dir)
        _say(rank, "LOADED", json.dumps({"path": path, "step": engine.global_steps,
                                         "client": client, "digest": _digest(engine)}))
    _train_step(engine, engine.global_steps)  # the batch of the step, so a resumed job goes on

    def save(tag):
        digest = _digest(engine)
        if rank == 0:
            _record(record_path, engine.global_steps, digest)
        _say(rank, "SAVE_BEGIN", engine.global_steps, tag)
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=tag, client_state={"step": engine.global_steps})
        _say(rank, "SAVE_END", engine.global_steps, f"{time.perf_counter() - t0:.4f}")

    _say(rank, "STALE_BEFORE", json.dumps(_leftovers(save_dir) if os.path.isdir(save_dir) else []))
    save(None)
    _say(rank, "STALE_AFTER", json.dumps(_leftovers(save_dir)))
    for _ in range(max_saves):
        _train_step(engine, engine.global_steps)
        save("rolling" if tag_mode == "same" else None)
    _say(rank, "NOT_KILLED")


def _worker_main():
    args = json.loads(sys.argv[2])
    sys.path[:0] = [HERE, os.path.join(ROOT, "examples")]
    _kill_worker(**args)


# ----- the test side -----------------------------------------------------------------------------

class Job:
    """`world` ranks of _kill_worker as separate processes (Gloo on loopback); rank 0's stdout is
    read line by line on a thread."""

    def __init__(self, world, timeout_s, **args):
        from harness import free_port
        port = free_port()
        self.lines = queue.Queue()
        self.seen = []
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", ZEROSHARD_TIMEOUT=str(timeout_s / 60.0))
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(args)],
                env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        self.stderr = [[] for _ in range(world)]
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True)]
        self._threads += [threading.Thread(target=self._read_stderr, args=(r,), daemon=True)
                          for r in range(world)]
        for t in self._threads:
            t.start()

    def _read_stdout(self):
        for line in self.procs[0].stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_stderr(self, rank):
        for line in self.procs[rank].stderr:
            self.stderr[rank].append(line)

    def wait_for(self, word, deadline):
        """The rest of rank 0's next line starting with `word`; fails when a rank dies first."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                pytest.fail(f"no {word!r} from rank 0 in time; it said: {self.seen[-5:]}\n{self.errors()}")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self.kill()
                pytest.fail(f"rank 0 ended before {word!r}; it said {self.seen[-5:]}\n{self.errors()}")
            self.seen.append(line)
            if line.split(" ", 1)[0] == word:
                return line[len(word) + 1:]

    def kill(self):
        for p in self.procs:  # every rank at once, each with whatever it started
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self):
        """Waits for every rank; returns their exit codes and rank 0's remaining lines."""
        codes = [p.wait(timeout=30) for p in self.procs]
        for t in self._threads:
            t.join(timeout=5)
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.seen.append(line)
        return codes

    def errors(self):
        return "\n".join(f"rank {r} stderr:\n" + "".join(e[-30:]) for r, e in enumerate(self.stderr))


def _records(path):
    with open(path) as f:
        return {r["step"]: r["digest"] for r in map(json.loads, f)}


# One line per trial: the job's world size and ZeRO stage, and whether its repeated saves replace
# one tag ("same": the RENAME_EXCHANGE path) or write a new one each time ("new"). Each job first
# loads what the previous job's kill left (a reshard where world or stage changes).
# 8 trials (CI's time budget): every stage, both tag modes at stages 1-3, worlds 1 and 2, with
# reshards between.
KILL_TRIALS = [
    (2, 3, "new"), (2, 3, "same"), (2, 1, "new"), (1, 2, "same"), (2, 2, "new"),
    (2, 0, "same"), (1, 3, "new"), (2, 1, "same"),
]
MODEL = {"d_model": 256, "n_layers": 4}  # ~3.2 M parameters: ~38 MB per save with Adam's moments


def test_kill_9_all_ranks_inside_a_save(tmp_path):
    rng = random.Random(18)
    save_dir = str(tmp_path / "ckpt")
    record_path = str(tmp_path / "saves.jsonl")
    outcome = None  # what the previous kill left: (steps that may be in `latest`, leftovers)
    stats = {"inside": 0, "after": 0, "left_tmp": 0, "got_new": 0, "got_old": 0}
    t_start = time.monotonic()
    for trial, (world, stage, tag_mode) in enumerate(KILL_TRIALS + [(1, 3, "new")]):
        last = trial == len(KILL_TRIALS)
        job = Job(world, 120, save_dir=save_dir, record_path=record_path, stage=stage, tag_mode=tag_mode,
                  load=outcome is not None, max_saves=0 if last else 200, **MODEL)
        deadline = time.monotonic() + 120
        where = f"trial {trial} (world {world}, stage {stage}, tags {tag_mode})"
        if outcome is not None:
            loaded = json.loads(job.wait_for("LOADED", deadline))
            allowed, leftovers = outcome
            records = _records(record_path)
            assert loaded["path"] is not None, f"{where}: load_checkpoint found no checkpoint"
            assert loaded["step"] in allowed, (
                f"{where}: latest holds step {loaded['step']}, expected one of {allowed} (the last "
                "save that finished, or the one the kill interrupted)")
            assert loaded["digest"] == records[loaded["step"]], (
                f"{where}: the weights or Adam moments loaded for step {loaded['step']} differ from "
                "the values that were saved")
            assert loaded["client"] == {"step": loaded["step"]}, f"{where}: client_state {loaded['client']}"
            stats["got_new" if loaded["step"] == max(allowed) else "got_old"] += 1
            stale = json.loads(job.wait_for("STALE_BEFORE", deadline))
            assert stale == leftovers, f"{where}: before the save, save_dir held {stale}, the kill left {leftovers}"
        save_a = int(job.wait_for("SAVE_BEGIN", deadline).split()[0])
        job.wait_for("SAVE_END", deadline)
        assert json.loads(job.wait_for("STALE_AFTER", deadline)) == [], (
            f"{where}: the save did not remove what the previous kill left")
        if last:
            job.wait_for("NOT_KILLED", deadline)
            assert job.finish() == [0] * world, job.errors()
            break
        # One repeated save runs to the end, to time it; the kill lands somewhere inside the next.
        job.wait_for("SAVE_BEGIN", deadline)
        seconds_b = float(job.wait_for("SAVE_END", deadline).split()[1])
        job.wait_for("SAVE_BEGIN", deadline)
        time.sleep(rng.uniform(0.0, 1.25 * seconds_b))
        job.kill()
        codes = job.finish()
        assert codes == [-signal.SIGKILL] * world, f"{where}: exit codes {codes}\n{job.errors()}"
        begun = [int(s.split()[1]) for s in job.seen if s.startswith("SAVE_BEGIN ")]
        ended = [int(s.split()[1]) for s in job.seen if s.startswith("SAVE_END ")]
        assert begun[0] == save_a and ended[0] == save_a
        in_flight = begun[-1] if len(begun) > len(ended) else None
        stats["inside" if in_flight is not None else "after"] += 1
        allowed = [ended[-1]] + ([in_flight] if in_flight is not None else [])
        leftovers = _leftovers(save_dir)
        stats["left_tmp"] += bool(leftovers)
        outcome = (allowed, leftovers)
    elapsed = time.monotonic() - t_start
    print(f"{len(KILL_TRIALS)} kills in {elapsed:.1f} s: {stats}")
    # The delays must mostly land inside a save, or the test proves little.
    assert stats["inside"] >= len(KILL_TRIALS) // 2, stats
    assert stats["left_tmp"] >= 2, stats  # the next save's clean-up of a half-written one ran


# ----- disk full ----------------------------------------------------------------------------------

def _pages(num_bytes, page):
    return -(-num_bytes // page)


def _free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill_to(fs_dir, free_bytes):
    """Leaves exactly `free_bytes` free on fs_dir's filesystem, by a file fs_dir/filler."""
    with open(os.path.join(fs_dir, "filler"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, _free_bytes(fs_dir) - free_bytes)
    assert _free_bytes(fs_dir) == free_bytes, (_free_bytes(fs_dir), free_bytes)


def _rank1_manifest_bytes(engine):
    """The size of rank 1's part of the manifest (save.py writes it beside its shard file, and
    rank 0 removes it once merged), found by writing rank 1's shard file elsewhere."""
    from zeroshard import _C
    from zeroshard.checkpoint.layout import RunView, rank_items
    with tempfile.TemporaryDirectory() as scratch:
        try:
            manifest = _C.checkpoint.write_shard_file(os.path.join(scratch, "rank00001.safetensors"),
                                                      rank_items(RunView.of(engine), False))
        finally:
            engine._core.end_entries(False)  # rank_items' caller ends the entries (as save.py)
        return len(manifest.to_json().encode())


# How much room the second save finds, in pages of the filesystem, from the sizes of the first
# (same model, same files): shard files s0, s1, rank 1's part of the manifest m1, manifest.json m.
# And whether rank 1 waits after its shard file, so that rank 0's reservation comes first and the
# room left is rank 1's to miss for its part of the manifest.
DISK_FULL = {
    "no room for any shard file": (lambda s0, s1, m1, m: 2, False),
    "room for one rank's shard file": (lambda s0, s1, m1, m: max(s0, s1) + 1, False),
    "room for the shard files, not rank 1's manifest": (lambda s0, s1, m1, m: s0 + s1, True),
    "room for all but manifest.json": (lambda s0, s1, m1, m: s0 + s1 + m1 + (m - m1) // 2, False),
    "room for all but latest": (lambda s0, s1, m1, m: s0 + s1 + max(m1, m), False),
}


def _slow_down_after_shard_file(seconds):
    from zeroshard import _C
    write = _C.checkpoint.write_shard_file

    def slow(*args, **kwargs):
        manifest = write(*args, **kwargs)
        time.sleep(seconds)
        return manifest

    _C.checkpoint.write_shard_file = slow  # save.py looks it up at each call


def _disk_full_worker(fs_dir, scenario):
    import torch.distributed as dist
    torch.set_num_threads(1)
    save_dir = os.path.join(fs_dir, "ckpt")
    engine = _engine(stage=3, d_model=32, n_layers=2)
    rank = engine.global_rank
    _train_step(engine, 0)
    digest_a, steps_a = _digest(engine), engine.global_steps
    engine.save_checkpoint(save_dir, tag="A")
    m1 = _rank1_manifest_bytes(engine) if rank == 1 else 0
    sizes = torch.tensor([m1])
    dist.all_reduce(sizes)  # rank 0 fills the disk, knowing rank 1's manifest size
    room, rank1_waits = DISK_FULL[scenario]
    if rank == 0:
        page = os.statvfs(fs_dir).f_frsize
        a = os.path.join(save_dir, "A")
        s0, s1, m = (os.path.getsize(os.path.join(a, f)) for f in
                     ("rank00000.safetensors", "rank00001.safetensors", "manifest.json"))
        _fill_to(fs_dir, room(*(_pages(n, page) for n in (s0, s1, int(sizes[0]), m))) * page)
    if rank == 1 and rank1_waits:
        _slow_down_after_shard_file(0.5)
    dist.barrier()

    _train_step(engine, 1)
    error = None
    try:
        engine.save_checkpoint(save_dir, tag="B")
    except Exception as e:  # noqa: BLE001 - the test wants it
        error = f"{type(e).__name__}: {e}"
    dist.barrier()  # every rank is out of the save before rank 0 looks
    listing = sorted(os.listdir(save_dir))
    with open(os.path.join(save_dir, "latest")) as f:
        latest = f.read()
    dist.barrier()  # before a load could change anything
    path, _ = engine.load_checkpoint(save_dir)
    loaded = {"path": path, "steps": engine.global_steps, "same": _digest(engine) == digest_a,
              "steps_a": steps_a}

    # With room again, the same save succeeds.
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(fs_dir, "filler"))
    dist.barrier()
    _train_step(engine, 1)
    digest_b = _digest(engine)
    engine.save_checkpoint(save_dir, tag="B")
    engine.load_checkpoint(save_dir)
    again = {"listing": sorted(os.listdir(save_dir)), "same": _digest(engine) == digest_b}
    return {"error": error, "listing": listing, "latest": latest, "loaded": loaded, "again": again}


@pytest.fixture(scope="module", params=list(DISK_FULL))
def disk_full(request, tmp_path_factory):
    """(scenario, save_dir, each rank's result) of one _disk_full_worker run at world 2, on a 2 MiB
    tmpfs mounted for it; each scenario runs once for the three tests below."""
    from harness import run_distributed
    scenario = request.param
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (this runs as uid %d)" % os.geteuid())
    fs_dir = str(tmp_path_factory.mktemp("fs"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", fs_dir],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (mount: {done.stderr.strip()})")
    try:
        yield scenario, os.path.join(fs_dir, "ckpt"), run_distributed(_disk_full_worker, 2, fs_dir, scenario,
                                                                      timeout=120)
    finally:
        subprocess.run(["umount", "-l", fs_dir], check=True)


def test_disk_full_keeps_the_previous_checkpoint(disk_full):
    scenario, save_dir, results = disk_full
    errors = [r["error"] for r in results]
    assert all(errors), f"{scenario}: save_checkpoint did not raise on every rank: {errors}"
    r0 = results[0]
    assert r0["latest"].strip() == "A", f"{scenario}: latest now says {r0['latest']!r}"
    assert not [e for e in r0["listing"] if e.startswith(LEFTOVER_PREFIXES)], r0["listing"]
    for rank, r in enumerate(results):
        loaded = r["loaded"]
        assert loaded["path"] == os.path.join(save_dir, "A") and loaded["steps"] == loaded["steps_a"], loaded
        assert loaded["same"], f"{scenario}: rank {rank} loaded other values than checkpoint A's"
        assert r["again"]["same"], f"{scenario}: the save with room again did not load back"
    assert r0["again"]["listing"] == ["A", "B", "latest"], r0["again"]["listing"]


def test_disk_full_error_names_the_path_and_the_bytes_on_every_rank(disk_full):
    """The issue: "ENOSPC names the path and the bytes needed", on every rank, since a launcher may
    show only rank 0's output while the full disk was another rank's."""
    scenario, save_dir, results = disk_full
    errors = [r["error"] or "(no error)" for r in results]
    vague = [f"rank {rank}: {e}" for rank, e in enumerate(errors)
             if not ("No space left on device" in e and save_dir in e and re.search(r"needs \d+ bytes", e))]
    assert not vague, f"{scenario}: errors that do not name the path and the bytes needed:\n" + "\n".join(vague)


def test_disk_full_error_is_true(disk_full):
    """A failed save leaves save_dir as it was (what the errors say: "nothing was committed")."""
    scenario, _, results = disk_full
    r0 = results[0]
    assert r0["listing"] == ["A", "latest"], (
        f"{scenario}: after the failed save of B, save_dir holds {r0['listing']}; the errors say "
        f"{[r['error'] for r in results]}")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main()
