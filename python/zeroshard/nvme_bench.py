"""zeroshard-nvme-bench: measures the NVMe I/O engine (_C.aio, the one NVMe offload swaps with) on the
disk under a directory, over a grid of block sizes, queue depths and I/O threads, for each kernel
backend that runs here, and prints the ds_config `aio` block with the fastest settings (DeepSpeed's
ds_nvme_tune does the same for its own op).

    zeroshard-nvme-bench --path /local_nvme            # 1 GiB file, the full grid (24 settings a backend)
    python3 -m zeroshard.nvme_bench --path /local_nvme --size 4GB --quick
"""
import argparse
import collections
import json
import os
import re
import statistics
import sys
import time

import torch  # noqa: F401  before _C: its tensor results need torch's Python types loaded

from zeroshard import _C

AIO = _C.aio
PROG = "zeroshard-nvme-bench"
DEFAULT_SIZE = "1GiB"  # about 1 s per direction at 1 GB/s: the grid takes minutes, not tens of them
BACKENDS = ("io_uring", "libaio")
# (block sizes, queue depths, I/O threads): the full grid and --quick's
GRID = (("256K", "1M", "4M"), (4, 8, 16, 32), (1, 2))
QUICK_GRID = (("256K", "1M"), (8,), (1, 2))
# The grid does not vary these; the runtime's defaults are measured and printed.
SINGLE_SUBMIT, OVERLAP_EVENTS = False, True
# Requests kept in flight at once. With one request the engine's queue drains at every wait; with
# four, after the oldest completes three are still queued while the next is submitted.
IN_FLIGHT_REQUESTS = 4
MIN_REQUEST_BYTES = 16 << 20  # ~16 ms at 1 GB/s: one Python call per request is small beside it

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS_ANY_CASE = {"": 1, **{unit.lower(): value for unit, value in _UNITS.items()}}


def parse_bytes(text):
    """'4GB' -> 4e9, '1GiB' / '1G' -> 2**30, '256K' -> 262144, '65536' -> 65536: KB/MB/GB are
    decimal (like disk vendors' figures), K/M/G and KiB/MiB/GiB binary (like fio's block sizes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS_ANY_CASE:
        raise ValueError(f"{text!r}: expected a byte count such as 4GB, 512MB, 1GiB, 256K or 1048576 "
                         f"(units: {', '.join(_UNITS)})")
    value = float(m.group(1)) * _UNITS_ANY_CASE[unit]
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r}: expected a whole, positive number of bytes")
    return int(value)


def format_bytes(n):
    """262144 -> '256K', 1048576 -> '1M', 1000001536 -> '1000001536' (the grid's labels)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def align_up(n, alignment=AIO.ALIGNMENT):
    return (n + alignment - 1) // alignment * alignment


def align_down(n, alignment=AIO.ALIGNMENT):
    return n // alignment * alignment


def check_directory(path):
    """The reason `path` cannot hold the test file, with the fix; None when it can."""
    if not os.path.exists(path):
        return (f"--path {path}: no such directory; create it (mkdir -p {path}) or pass a directory on the disk "
                f"to measure")
    if not os.path.isdir(path):
        return f"--path {path}: not a directory; pass the directory (on the disk to measure) to write the test file in"
    if not os.access(path, os.W_OK | os.X_OK):
        return (f"--path {path}: not writable by this user (uid {os.getuid()}); pass a directory you can write "
                f"to, or give yourself write access (chown/chmod)")
    return None


# ----- one measurement ----------------------------------------------------------------------------

def request_bytes(block_size, queue_depth, threads, buffer_bytes):
    """Bytes per request: half the engine's capacity (every thread's queue full), at least
    MIN_REQUEST_BYTES, so IN_FLIGHT_REQUESTS - 1 queued requests keep every queue full; at most a
    slot of the buffer."""
    want = align_up(max(MIN_REQUEST_BYTES, block_size * queue_depth * threads // 2))
    return max(AIO.ALIGNMENT, min(want, align_down(buffer_bytes // IN_FLIGHT_REQUESTS)))


def buffer_bytes_for(grid, file_bytes):
    """One buffer serves every measurement: IN_FLIGHT_REQUESTS of the grid's largest request."""
    block_sizes, depths, threads = grid
    largest = request_bytes(max(block_sizes), max(depths), max(threads), 1 << 62)
    return min(file_bytes, IN_FLIGHT_REQUESTS * largest)


def move_file(engine, file, buffer, file_bytes, chunk_bytes, is_write):
    """Writes (or reads) the whole file once, `chunk_bytes` per request, IN_FLIGHT_REQUESTS
    requests at a time, each in its own slot of `buffer`; returns the seconds it took."""
    slots = buffer.numel() // chunk_bytes
    start_io = engine.write if is_write else engine.read
    pending = collections.deque()
    start = time.perf_counter()
    try:
        for index, offset in enumerate(range(0, file_bytes, chunk_bytes)):
            if len(pending) == slots:
                pending.popleft().wait()  # frees the slot this request reuses
            nbytes = min(chunk_bytes, file_bytes - offset)
            view = buffer.narrow(0, (index % slots) * chunk_bytes, nbytes)
            pending.append(start_io(file, view, nbytes, offset))
        while pending:
            pending.popleft().wait()
        return time.perf_counter() - start
    finally:
        # An error or Ctrl-C: what the kernel holds must finish before the buffer and file can go.
        for request in pending:
            try:
                request.wait()
            except _C.Error:
                pass


def measure(setting, file, buffer, file_bytes, repeat):
    """Median write and read GB/s (1e9 bytes/s) of `repeat` passes over the file at `setting`."""
    backend, block_size, queue_depth, threads = setting
    engine = AIO.AioEngine(block_size=block_size, queue_depth=queue_depth, intra_op_parallelism=threads,
                           single_submit=SINGLE_SUBMIT, overlap_events=OVERLAP_EVENTS, backend=backend)
    chunk = request_bytes(block_size, queue_depth, threads, buffer.numel())
    writes, reads = [], []
    for _ in range(repeat):
        writes.append(file_bytes / move_file(engine, file, buffer, file_bytes, chunk, True) / 1e9)
        reads.append(file_bytes / move_file(engine, file, buffer, file_bytes, chunk, False) / 1e9)
    return {"backend": backend, "block_size": block_size, "queue_depth": queue_depth, "threads": threads,
            "request_bytes": chunk, "write_gbps": statistics.median(writes), "read_gbps": statistics.median(reads)}


# ----- the grid, the table and the advice ---------------------------------------------------------

def runnable_backends():
    """{backend: None if it runs here, else why not}."""
    why_not = {}
    for backend in BACKENDS:
        try:
            AIO.AioEngine(queue_depth=1, backend=backend)
            why_not[backend] = None
        except _C.Error as e:
            why_not[backend] = str(e)
    return why_not


class Progress:
    """One line per measurement on stderr: a tqdm bar when tqdm is installed and stderr is a
    terminal, else plain lines (a log keeps them readable)."""

    def __init__(self, total):
        self.total, self.done, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, unit="setting", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, line):
        self.done += 1
        if self.bar is None:
            print(f"[{self.done}/{self.total}] {line}", file=sys.stderr, flush=True)
        else:
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.update()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def combined_gbps(row):
    """The rate of writing then reading the file once: what one swap out and in costs."""
    return 2 / (1 / row["write_gbps"] + 1 / row["read_gbps"])


def print_table(rows, out=None):
    out = out or sys.stdout
    print("| backend | block size | queue depth | threads | read GB/s | write GB/s |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(f"| {r['backend']} | {format_bytes(r['block_size'])} | {r['queue_depth']} | {r['threads']} "
              f"| {r['read_gbps']:.3f} | {r['write_gbps']:.3f} |", file=out)


def aio_block(row):
    return {"aio": {"block_size": row["block_size"], "queue_depth": row["queue_depth"],
                    "intra_op_parallelism": row["threads"], "single_submit": SINGLE_SUBMIT,
                    "overlap_events": OVERLAP_EVENTS}}


def print_advice(rows, runtime_backend, out=None):
    """The fastest setting on the backend the runtime will use (the ds_config has no backend key:
    the runtime takes io_uring where it runs), noting when the other backend beat it."""
    out = out or sys.stdout
    best = max((r for r in rows if r["backend"] == runtime_backend), key=combined_gbps)
    overall = max(rows, key=combined_gbps)
    print(f"\nfastest write+read on {runtime_backend} (the backend the runtime uses here): "
          f"{format_bytes(best['block_size'])} blocks, queue depth {best['queue_depth']}, "
          f"{best['threads']} thread(s): read {best['read_gbps']:.3f} GB/s, write {best['write_gbps']:.3f} GB/s",
          file=out)
    if overall is not best:
        print(f"note: {overall['backend']} was faster ({combined_gbps(overall):.3f} against "
              f"{combined_gbps(best):.3f} GB/s write+read); the runtime picks io_uring where it runs",
              file=out)
    print("aio block for the ds_config:", file=out)
    print(json.dumps(aio_block(best), indent=2), file=out, flush=True)


def settings_of(grid, backends):
    block_sizes, depths, threads = grid
    return [(b, bs, qd, t) for b in backends for bs in block_sizes for qd in depths for t in threads]


def open_test_file(path, file_bytes):
    """The test file, its blocks reserved: an IoError now if the filesystem refuses O_DIRECT or lacks
    the space, rather than in the middle of the grid."""
    file = AIO.DirectFile(path, create=True)
    file.preallocate(file_bytes)
    return file


def run(args, grid, file):
    """Writes the test file, measures every setting, prints the table and the advice."""
    file_bytes = args.size_bytes
    why_not = runnable_backends()
    backends = [b for b in BACKENDS if why_not[b] is None]
    for b in BACKENDS:
        if why_not[b] is not None:
            print(f"{PROG}: {b} cannot run here, not measured: {why_not[b]}", file=sys.stderr)
    if not backends:
        raise _C.Error("neither io_uring nor libaio can run here (see above)")
    runtime_backend = AIO.AioEngine(queue_depth=1).backend
    buffer = AIO.aligned_buffer(buffer_bytes_for(grid, file_bytes))
    buffer.random_(0, 256)  # not zeros: some virtual disks and SSDs store zeros for free
    settings = settings_of(grid, backends)
    print(f"{PROG}: {file.path}: {file_bytes} bytes ({file_bytes / 1e9:.3f} GB), a {buffer.numel() / 2**20:.1f} MiB "
          f"buffer, {len(settings)} settings x {args.repeat} pass(es); backends: {', '.join(backends)} "
          f"(runtime: {runtime_backend})", file=sys.stderr, flush=True)
    # The first write allocates the file's blocks; measured passes then overwrite, as swaps do.
    move_file(AIO.AioEngine(), file, buffer, file_bytes, request_bytes(1 << 20, 8, 1, buffer.numel()), True)

    rows, progress = [], Progress(len(settings))
    try:
        for setting in settings:
            row = measure(setting, file, buffer, file_bytes, args.repeat)
            rows.append(row)
            progress.update(f"{row['backend']} bs={format_bytes(row['block_size'])} qd={row['queue_depth']} "
                            f"threads={row['threads']}: read {row['read_gbps']:.3f} GB/s, "
                            f"write {row['write_gbps']:.3f} GB/s")
    finally:
        progress.close()
    print_table(rows)
    print_advice(rows, runtime_backend)
    return rows


def _parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="an existing, writable directory on the disk to measure "
                   "(the one to give offload_optimizer.nvme_path); a test file is written there and removed")
    p.add_argument("--size", default=DEFAULT_SIZE,
                   help=f"test file size (default {DEFAULT_SIZE}); e.g. 4GB, 512MB, 1GiB, 1048576: KB/MB/GB are "
                   "decimal, K/M/G and KiB/MiB/GiB binary; rounded up to a multiple of 4096")
    p.add_argument("--quick", action="store_true", help="a small grid: block sizes 256K and 1M, queue "
                   "depth 8, 1 and 2 threads")
    p.add_argument("--block-sizes", nargs="+", default=None, help=f"default {' '.join(GRID[0])}")
    p.add_argument("--queue-depths", nargs="+", type=int, default=None,
                   help=f"default {' '.join(map(str, GRID[1]))}")
    p.add_argument("--threads", nargs="+", type=int, default=None,
                   help=f"intra_op_parallelism values, default {' '.join(map(str, GRID[2]))}")
    p.add_argument("--repeat", type=int, default=1, help="passes per setting; the median is shown")
    return p


def _grid(args, p):
    base = QUICK_GRID if args.quick else GRID
    try:
        block_sizes = [parse_bytes(b) for b in (args.block_sizes or base[0])]
    except ValueError as e:
        p.error(f"--block-sizes: {e}")
    for b in block_sizes:
        if b % AIO.ALIGNMENT:
            p.error(f"--block-sizes: {b} is not a multiple of {AIO.ALIGNMENT} (O_DIRECT)")
    depths, threads = args.queue_depths or base[1], args.threads or base[2]
    if min(depths) < 1 or min(threads) < 1 or args.repeat < 1:
        p.error("--queue-depths, --threads and --repeat take values >= 1")
    return block_sizes, depths, threads


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    try:
        args.size_bytes = align_up(parse_bytes(args.size))
    except ValueError as e:
        p.error(f"--size: {e}")  # exits with status 2
    grid = _grid(args, p)
    problem = check_directory(args.path)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    path = os.path.join(os.path.abspath(args.path), f"zeroshard-nvme-bench-{os.getpid()}.tmp")
    try:
        try:
            file = open_test_file(path, args.size_bytes)
        except _C.IoError as e:  # the directory cannot hold the test: its filesystem or its free space
            print(f"{PROG}: error: --path {args.path}: {e}", file=sys.stderr)
            return 2
        run(args, grid, file)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; test file removed", file=sys.stderr)
        return 130
    except (_C.Error, ValueError) as e:  # a failed request names its file, offset and reason
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    finally:
        if os.path.exists(path):
            os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
