"""The bench scripts' rank processes (bench/pipeline.py, bench/pipeline_eval.py): one process per
rank, spawned fresh, with one thread, Gloo on loopback, the same CPU per rank under --pin and the
same glibc allocator settings for every framework; a rank that raises, dies or hangs ends the run
with its reason; DeepSpeed's ranks run in DeepSpeed's own venv."""
import contextlib
import json
import os
import queue as queue_module
import signal
import socket
import subprocess
import time

import torch
import torch.multiprocessing as mp

PIN_ENV = "ZS_BENCH_PIN"  # --pin's CPUs in rank order ("0,2"); the ranks' processes (DeepSpeed's venv too) inherit it
RUN_TIMEOUT_S = 600   # one framework, one schedule, all steps
PEER_GRACE_S = 20     # after one rank raised, how long its peer gets to report before it is killed
# glibc's malloc moves its mmap threshold up to the largest mmapped block freed so far (up to 32 MiB)
# and trims the heap above twice that, so each rank process's allocation history decides how often
# its activations come back as fresh pages. Fixed values, the same in every framework's ranks, take
# that history out of the comparison (bench/RESULTS.md, "the same glibc allocator settings").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}


def apply_malloc_env(as_is):
    """Exports MALLOC_ENV for the ranks spawned after this (glibc reads it when a process starts),
    unless `as_is` (the scripts' --malloc-as-is); returns the header's words for it."""
    if as_is:
        return "glibc's malloc thresholds as each rank process's history sets them"
    os.environ.update(MALLOC_ENV)
    fixed = ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    return f"glibc's malloc thresholds fixed alike in every rank ({fixed})"


def own_process_group(fn):
    """Marks a rank function that sets up torch.distributed itself (DeepSpeed's init_distributed)."""
    fn.own_process_group = True
    return fn


class Stopped(Exception):
    """SIGTERM (e.g. from `timeout`) reached the bench: it stops and reports the runs that finished."""


def stop(signum, frame):
    """The SIGTERM handler while runs go on."""
    raise Stopped()


def reason(error):
    """An exception as one short line: its type and its message's first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def _entry(fn, rank, world, port, args, queue):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        if os.environ.get(PIN_ENV):  # --pin: every framework's rank r on the same CPU
            os.sched_setaffinity(0, {int(os.environ[PIN_ENV].split(",")[rank])})
        import torch.distributed as dist
        if not getattr(fn, "own_process_group", False):
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = (True, fn(*args))
    except BaseException as error:  # noqa: BLE001 - spawn reports it, naming the rank
        result = (False, reason(error))
    queue.put((rank, *result))


def spawn(fn, world, *args, timeout=RUN_TIMEOUT_S):
    """fn(world, *args) on `world` ranks, one process each. Returns {"ranks": [rank 0's result, ...]} or
    {"error": why}: a rank raised (its exception), died without a result (its exit code), or did not
    finish within `timeout` seconds (a hang)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, (world, *args), queue)) for r in range(world)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, queue, timeout)
    finally:  # also when the bench itself is stopped (Stopped): no rank outlives it
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join()


def _collect(procs, queue, timeout):
    results, errors = {}, {}
    deadline = time.monotonic() + timeout

    def receive(wait_s):
        rank, ok, value = queue.get(timeout=wait_s)
        (results if ok else errors)[rank] = value
        return ok

    while len(results) + len(errors) < len(procs):
        try:
            if not receive(1.0):
                # Its peer is likely blocked on it until Gloo's own (30 min) timeout.
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
            continue
        except queue_module.Empty:
            pass
        for r, p in enumerate(procs):
            if r in results or r in errors or p.is_alive():
                continue
            try:  # a result put just before exiting may still be in the pipe
                while True:
                    receive(0.5)
            except queue_module.Empty:
                pass
            if r not in results and r not in errors:
                errors[r] = f"exited with code {p.exitcode} before reporting a result"
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        if time.monotonic() > deadline:
            for r in range(len(procs)):
                if r not in results and r not in errors:
                    errors[r] = (f"killed {PEER_GRACE_S} s after its peer failed" if errors
                                 else f"did not finish within {timeout} s (a hang)")
            break
    if errors:
        return {"error": "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))}
    return {"ranks": [results[r] for r in range(len(procs))]}


def run_deepspeed(num_stages, m, steps, venv, module="pipeline", rank_fn="deepspeed_rank"):
    """`module`.`rank_fn` (a bench script in this folder and its DeepSpeed rank) on spawned ranks,
    run by DeepSpeed's venv's python."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return {"error": f"not installed (no {python}; --deepspeed-venv names DeepSpeed's venv)"}
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json\ntry:\n    import deepspeed\nexcept ImportError as e:\n"
            "    print('RESULT', json.dumps({'error': 'not installed in ' + %r + ': ' + str(e)}))\n    raise SystemExit\n"
            "import %s as b\nprint('RESULT', json.dumps(b.spawn(b.%s, %d, %d, %d)))"
            % (venv, module, rank_fn, num_stages, m, steps))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=here)
    limit_s = RUN_TIMEOUT_S + 120
    # A session of its own, so a timeout kills the ranks it spawned too.
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"did not finish within {limit_s} s (killed)"}
    except Stopped:
        with contextlib.suppress(ProcessLookupError):  # its group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exited with code {proc.returncode}: " + (err.strip().splitlines() or ["no output"])[-1][:200]}
