"""Runs a test body in `world_size` processes on loopback with Gloo: free port, a per-test timeout
(every rank is killed when it passes), and each rank's failure or skip passed back to pytest.

Ranks start from multiprocessing's fork server, which imports torch once: each rank is a fresh
fork of it (nothing a test does carries over to the next), without the ~2 s of CPU each rank's
own `import torch` took with "spawn" (a world-4 test spent 5 s starting). A fork of the server
would inherit the server's environment and stdio, so each rank is handed the test's current ones.
zeroshard itself is not preloaded: it reads settings from the environment at import."""
import atexit
import ctypes
import multiprocessing as mp
import multiprocessing.reduction
import os
import queue
import socket
import sys
import time
import traceback

import pytest

_context = None


def _start_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "numpy"])
    return _context


class _Stdio:
    """This process's stdout and stderr, duplicated into a rank started by the fork server (so
    that pytest's capture, capfd included, sees the ranks' output as with spawn)."""

    def __reduce__(self):
        return (_Stdio._attach, (mp.reduction.DupFd(1), mp.reduction.DupFd(2)))

    @staticmethod
    def _attach(out, err):
        return out.detach(), err.detach()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args, kwargs, environ, env, stdio):
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        torch.set_num_threads(1)  # several ranks share two cores
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except pytest.skip.Exception as e:
        results.put((rank, "skip", str(e)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        _exit_as_a_process_does(results)


def _exit_as_a_process_does(results):
    """A fork of the server ends in os._exit, which skips what a process runs at exit: Python's
    atexit handlers (zeroshard's teardown) and the C library's (zeroshard's C++ removes the NVMe
    swap directories of the engines still alive). Tests check that clean-up, so the rank ends the
    way an interpreter does: Python's handlers, then exit(3) for the C ones, once its result has
    reached the parent (the queue's feeder thread would not outlive exit)."""
    results.close()
    results.join_thread()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).exit(0)


def _start_ranks(fn, world_size, args, kwargs, timeout, env):
    ctx = _start_context()
    results = ctx.Queue()
    port = free_port()
    # Counting FLOPs for the progress line's TFLOPS imports torch._dynamo (~1.3 s of CPU once per
    # process): off unless a test turns it on (tests/python/test_observe.py).
    base_env = {"ZEROSHARD_TIMEOUT": str(timeout / 60.0), "OMP_NUM_THREADS": "1", "ZEROSHARD_COUNT_FLOPS": "0"}
    base_env.update(env or {})
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, kwargs, environ,
                                              base_env, _Stdio()),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results


def _end_ranks(procs):
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def run_distributed(fn, world_size, *args, timeout=180, env=None, **kwargs):
    """Calls fn(*args, **kwargs) on ranks 0..world_size-1; returns their return values by rank."""
    procs, results = _start_ranks(fn, world_size, args, kwargs, timeout, env)
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                pytest.fail(f"ranks {missing} of {world_size} did not finish within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                got[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    pytest.fail(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                f"before reporting")
    finally:
        _end_ranks(procs)
    errors = [(r, v) for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        rank, tb = errors[0]
        pytest.fail(f"rank {rank} of {world_size} failed:\n{tb}", pytrace=False)
    skips = [v for _, (s, v) in sorted(got.items()) if s == "skip"]
    if skips:
        pytest.skip(skips[0])
    return [got[r][1] for r in range(world_size)]


def run_tolerating_deaths(fn, world_size, *args, timeout, env):
    """run_distributed for tests whose ranks die on purpose (or by Gloo's hand): collects what
    the surviving ranks report instead of failing at the first death. Returns
    ({rank: (status, value)}, exit codes)."""
    procs, results = _start_ranks(fn, world_size, args, {}, timeout, env)
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            pending = [r for r in range(world_size) if r not in got and procs[r].exitcode is None]
            if not pending:
                break
            try:
                rank, status, value = results.get(timeout=1.0)
                got[rank] = (status, value)
            except queue.Empty:
                pass
        while True:  # results put just before a rank exited
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                break
    finally:
        _end_ranks(procs)
    return got, [p.exitcode for p in procs]


# engine.memory_bytes()'s host categories, all zero in a run without offload (issue 19).
NO_HOST_BYTES = {"host_parameters": 0, "host_master_weights": 0, "host_optimizer_state": 0,
                 "host_buffers": 0}
