"""Runs a test body in `world_size` processes on loopback with Gloo: free port, a per-test timeout
(every rank is killed when it passes), and each rank's failure or skip passed back to pytest."""
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args, kwargs, env):
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


def run_distributed(fn, world_size, *args, timeout=180, env=None, **kwargs):
    """Calls fn(*args, **kwargs) on ranks 0..world_size-1; returns their return values by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base_env = {"ZEROSHARD_TIMEOUT": str(timeout / 60.0), "OMP_NUM_THREADS": "1"}
    base_env.update(env or {})
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, kwargs, base_env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
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
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [(r, v) for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        rank, tb = errors[0]
        pytest.fail(f"rank {rank} of {world_size} failed:\n{tb}", pytrace=False)
    skips = [v for _, (s, v) in sorted(got.items()) if s == "skip"]
    if skips:
        pytest.skip(skips[0])
    return [got[r][1] for r in range(world_size)]


# engine.memory_bytes()'s host categories, all zero in a run without offload (issue 19).
NO_HOST_BYTES = {"host_parameters": 0, "host_master_weights": 0, "host_optimizer_state": 0,
                 "host_buffers": 0}
