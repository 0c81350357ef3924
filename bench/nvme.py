"""NVMe I/O benchmark (issue 20, the I/O part): sequential O_DIRECT write and read GB/s of zeroshard's
engine (_C.aio, io_uring and libaio) against fio (the same two kernel interfaces) and DeepSpeed's
async_io op (`aio_handle`, libaio), on one file in one directory, at the same block size and queue
depths, one I/O thread each.

    python3 bench/nvme.py --path /tmp                      # 1 GiB, 1 MiB blocks, QD 8 and 32, 5 rounds
    python3 bench/nvme.py --path /mnt/nvme --size 4GiB --queue-depths 8 --rounds 3 --json out.json

Each pass moves the whole file once, sequentially:
  fio        one job: --rw=write|read --bs --iodepth --direct=1 --ioengine=io_uring|libaio --size;
             its own bandwidth figure (bw_bytes) is taken.
  zeroshard  one AioEngine(block_size, queue_depth, intra_op_parallelism=1, single_submit=False,
             overlap_events=True, backend) per setting; one write (read) request of the whole file
             from (into) a 4096-aligned buffer, timed from submission to the end of its wait().
  DeepSpeed  AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit=False,
             overlap_events=True, intra_op_parallelism=1), under its venv's python with
             DS_ACCELERATOR=cpu; async_pwrite (async_pread) of a page-locked tensor from
             new_cpu_locked_tensor (as its ds_io benchmark does on CPU) of the whole file, then
             wait(), timed around both (it opens the file inside the call).
Every implementation writes and reads the same preallocated file, overwriting blocks the first
write allocated. Rounds interleave the implementations, each round starting one later, so drift on
a shared disk hits them alike; the table shows the median (min-max) over rounds. GB = 1e9 bytes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_step import DS_PYTHON_DEFAULT  # noqa: E402

# name -> (label, kernel interface)
IMPLS = {
    "fio-io_uring": ("fio", "io_uring"),
    "fio-libaio": ("fio", "libaio"),
    "zs-io_uring": ("zeroshard", "io_uring"),
    "zs-libaio": ("zeroshard", "libaio"),
    "ds": ("DeepSpeed", "libaio"),
}
OPS = ("write", "read")


# ----------------------------------------------------------------------------------------------
# worker side: one process per (round, implementation), every queue depth and both operations
# ----------------------------------------------------------------------------------------------

def zs_worker(a):
    """{(op, qd): GB/s} of zeroshard's engine, one whole-file request per pass."""
    import torch  # noqa: F401  before _C: its tensor results need torch's Python types
    from zeroshard import _C
    buffer = _C.aio.aligned_buffer(a.size)
    buffer.random_(0, 256)  # not zeros: a virtual disk may store zeros for free
    file = _C.aio.DirectFile(a.file, create=False)
    out = {}
    for qd in a.queue_depths:
        engine = _C.aio.AioEngine(block_size=a.block_size, queue_depth=qd, intra_op_parallelism=1,
                                  single_submit=False, overlap_events=True, backend=IMPLS[a.worker][1])
        for op in OPS:
            start_io = engine.write if op == "write" else engine.read
            t0 = time.perf_counter()
            start_io(file, buffer, a.size, 0).wait()
            out[f"{op}/{qd}"] = a.size / (time.perf_counter() - t0) / 1e9
    return out


def ds_worker(a):
    """{(op, qd): GB/s} of DeepSpeed's aio_handle, one whole-file async op and wait() per pass."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load()
    out = {}
    for qd in a.queue_depths:
        h = aio.aio_handle(a.block_size, qd, False, True, 1)
        buffer = h.new_cpu_locked_tensor(a.size, torch.empty(0, dtype=torch.uint8))
        buffer.random_(0, 256)
        for op in OPS:
            t0 = time.perf_counter()
            rc = (h.async_pwrite if op == "write" else h.async_pread)(buffer, a.file)
            if rc != 0 or h.wait() != 1:
                raise RuntimeError(f"DeepSpeed aio_handle {op} of {a.file}: async call returned {rc}")
            out[f"{op}/{qd}"] = a.size / (time.perf_counter() - t0) / 1e9
        h.free_cpu_locked_tensor(buffer)
    return out


def worker(a):
    out = ds_worker(a) if a.worker == "ds" else zs_worker(a)
    with open(a.result, "w") as f:
        json.dump(out, f)


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

def fio_pass(a, engine, op, qd):
    """GB/s of one fio job over the file."""
    argv = ["fio", "--name=zeroshard-bench", f"--filename={a.file}", f"--rw={op}", f"--bs={a.block_size}",
            f"--iodepth={qd}", "--direct=1", f"--ioengine={engine}", f"--size={a.size}", "--numjobs=1",
            "--output-format=json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


def run_worker(impl, a, result_dir):
    """One round of a zeroshard or DeepSpeed worker process: {"op/qd": GB/s}."""
    result = os.path.join(result_dir, f"{impl}.json")
    python = a.ds_python if impl == "ds" else sys.executable
    argv = [python, os.path.abspath(__file__), "--worker", impl, "--result", result, "--file", a.file,
            "--size", str(a.size), "--block-size", str(a.block_size),
            "--queue-depths"] + [str(q) for q in a.queue_depths]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    if out.returncode != 0 or not os.path.exists(result):
        tail = (out.stdout + out.stderr).strip()[-1500:]
        raise RuntimeError(f"{impl} worker exited {out.returncode}:\n{tail}")
    with open(result) as f:
        gbps = json.load(f)
    os.remove(result)
    return gbps


def one_round(impl, a, result_dir):
    label, engine = IMPLS[impl]
    if label == "fio":
        return {f"{op}/{qd}": fio_pass(a, engine, op, qd) for qd in a.queue_depths for op in OPS}
    return run_worker(impl, a, result_dir)


def make_file(a):
    """The test file, preallocated and written once (so every measured write overwrites)."""
    fd = os.open(a.file, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, a.size)
    finally:
        os.close(fd)
    fio_pass(a, "libaio", "write", 8)


def fmt(samples):
    if not samples:
        return "not run"
    return f"{statistics.median(samples):.3f} ({min(samples):.3f}-{max(samples):.3f})"


def ratio(samples, base):
    return f"{statistics.median(samples) / statistics.median(base):.2f}" if samples and base else ""


def print_table(a, results, failures):
    impls = [i for i in IMPLS if i in a.impls]
    cols = ["op", "QD"] + [f"{IMPLS[i][0]} {IMPLS[i][1]}" if i != "ds" else "DeepSpeed aio_handle (libaio)"
                           for i in impls]
    pairs = [("zs-io_uring", "fio-io_uring"), ("zs-libaio", "fio-libaio"), ("zs-io_uring", "ds"),
             ("zs-libaio", "ds")]
    pairs = [(x, y) for x, y in pairs if x in impls and y in impls and y not in failures]
    cols += [f"{IMPLS[x][0]} {IMPLS[x][1]} / {IMPLS[y][0]} {IMPLS[y][1]}" for x, y in pairs]
    print(f"GB/s, median (min-max) of {a.rounds} rounds; {a.size} bytes, {a.block_size}-byte blocks, "
          f"{a.file}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for qd in a.queue_depths:
        for op in OPS:
            key = f"{op}/{qd}"
            cells = [op, str(qd)] + [fmt(results[i][key]) for i in impls]
            cells += [ratio(results[x][key], results[y][key]) for x, y in pairs]
            print("| " + " | ".join(cells) + " |")
    for impl, why in failures.items():
        print(f"\n{impl} not measured: {why}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument("--size", type=int, default=1 << 30, help="file bytes (default 1 GiB)")
    p.add_argument("--block-size", dest="block_size", type=int, default=1 << 20)
    p.add_argument("--queue-depths", dest="queue_depths", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--ds-python", dest="ds_python", default=DS_PYTHON_DEFAULT)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    p.add_argument("--json", default=None, help="also write every sample here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.size % (1 << 20) or a.block_size % 4096:
        p.error("--size must be a multiple of 1 MiB and --block-size of 4096 (O_DIRECT)")
    a.file = os.path.join(os.path.abspath(a.path), f"zeroshard-bench-nvme-{os.getpid()}.dat")
    keys = [f"{op}/{qd}" for qd in a.queue_depths for op in OPS]
    results = {i: {k: [] for k in keys} for i in a.impls}
    failures = {}
    try:
        make_file(a)
        with tempfile.TemporaryDirectory(prefix="nvme.") as result_dir:
            for r in range(a.rounds):
                # Each round starts one implementation later: none always follows the same neighbour.
                for impl in a.impls[r % len(a.impls):] + a.impls[:r % len(a.impls)]:
                    if impl in failures:
                        continue
                    t0 = time.time()
                    try:
                        gbps = one_round(impl, a, result_dir)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        failures[impl] = str(e)
                        print(f"# round {r + 1} {impl}: FAILED: {e}", file=sys.stderr, flush=True)
                        continue
                    for k in keys:
                        results[impl][k].append(gbps[k])
                    print(f"# round {r + 1} {impl}: {time.time() - t0:.1f} s: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in gbps.items()), file=sys.stderr, flush=True)
    finally:
        if os.path.exists(a.file):
            os.remove(a.file)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "gbps": results, "failures": failures}, f, indent=1)
    print_table(a, results, failures)


if __name__ == "__main__":
    main()
