"""ZeRO training-step benchmark (issue 3): step time and model-state memory per rank of zeroshard
stages 0-3 and their peers (torch DDP, ZeroRedundancyOptimizer, FSDP2 fully_shard, DeepSpeed) on the
same ~100M-parameter GPT, world 2, CPU/Gloo, one thread per rank, each implementation in its own pair
of processes.

    python3 bench/zero_step.py                       # everything, fp32, table on stdout
    python3 bench/zero_step.py --impls zs2 fsdp2-ra0 --steps 3 --json out.json

Step time: every rank times each step (forward, backward, optimizer step), the per-step maximum over
ranks is kept, and the table shows the median (min-max) of the timed steps after the warm-up.
Memory, per rank (maximum over the two ranks):
  model state  zeroshard: the runtime's own accounting, peak per category summed (comm buffers
               excluded, shown apart). Peers: bytes of the unique tensor storages reachable from the
               model, the optimizer and the wrapper objects (parameters, gradients, optimizer state,
               gathered/unsharded parameters, flat buffers), sampled after forward, after backward
               and after the optimizer step of the last warm-up step, the largest kept; DeepSpeed's
               ipg gradient-staging buckets are shown apart as comm buffers.
  reachable    the same reachability walk run on every implementation, zeroshard included.
  peak RSS     resource.getrusage(RUSAGE_SELF).ru_maxrss of the rank process, and its rise over the
               RSS measured after the imports, before the model is built.
  peak heap    the most bytes ever live in malloc'd blocks (bench/memtrack/memtrack.c, preloaded
               into every rank of every implementation), and its rise over the live bytes after
               the imports. Unlike RSS it counts every transient buffer and none of the memory
               the allocator keeps after a free, so it is the like-for-like peak of what each
               implementation holds. Split in the JSON into set-up and training steps.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DS_PYTHON_DEFAULT = "/tmp/ds-venv/bin/python"

# name -> (label, stage, peer family)
IMPLS = {
    "zs0": ("zeroshard", 0),
    "ddp": ("torch DDP", 0),
    "ds0": ("DeepSpeed", 0),
    "zs1": ("zeroshard", 1),
    "zero-r": ("torch ZeroRedundancyOptimizer", 1),
    "ds1": ("DeepSpeed", 1),
    "zs2": ("zeroshard", 2),
    "fsdp2-ra0": ("torch FSDP2 reshard_after_forward=False", 2),
    "ds2": ("DeepSpeed", 2),
    "zs3": ("zeroshard", 3),
    # DeepSpeed's default stage3_max_reuse_distance (1e9 elements) keeps every parameter of a 100M
    # model gathered from its forward use to its backward use, and its default
    # stage3_prefetch_bucket_size (5e7) gathers half of this model ahead. FSDP2's
    # reshard_after_forward=True instead frees each block after its forward, gathers it again in
    # backward and prefetches one block: reuse distance 0 and a 1e7-element (about one block)
    # prefetch do the same.
    "zs3-r0": ("zeroshard reuse distance 0, prefetch 1e7", 3),
    # The same without overlap_comm: one gradient bucket in flight instead of two.
    "zs3-r0-seq": ("zeroshard reuse distance 0, prefetch 1e7, overlap_comm false", 3),
    # What observability costs: zs3 with the per-rank trace of every step (written at exit), and
    # with the comms logger (bench/observe_overhead.py compares them inside one run).
    "zs3-trace": ("zeroshard, trace on", 3),
    "zs3-comms": ("zeroshard, comms_logger on", 3),
    "fsdp2-ra1": ("torch FSDP2 reshard_after_forward=True", 3),
    "ds3": ("DeepSpeed", 3),
}
# zeroshard implementation -> the torch peer it is held against
PEER = {"zs0": "ddp", "zs1": "zero-r", "zs2": "fsdp2-ra0", "zs3": "fsdp2-ra1", "zs3-r0": "fsdp2-ra1",
        "zs3-r0-seq": "fsdp2-ra1", "zs3-trace": "zs3", "zs3-comms": "zs3"}
# zeroshard config keys each variant sets on top of the shared config
ZS_EXTRA = {"zs3-r0": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 10000000},
            "zs3-r0-seq": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 10000000,
                           "overlap_comm": False}}
# top-level config keys each variant sets
TOP_EXTRA = {"zs3-trace": lambda: {"trace": {"enabled": True, "output_path": tempfile.mkdtemp(prefix="zs3-trace-")}},
             "zs3-comms": lambda: {"comms_logger": {"enabled": True}}}


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def _rss_now_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Gradient-reduction staging buffers (DeepSpeed's ipg buckets) are not model state; they are counted
# apart, like zeroshard's comm_buffers category.
COMM_BUFFER_PATH = re.compile(r"ipg_bucket|ipg_buffer")


def reachable_tensor_bytes(roots, top=None):
    """Bytes of the unique tensor storages reachable from roots through attributes, containers,
    module parameters and .grad, as (model-state bytes, comm-buffer bytes). DTensors count their
    local shard. With top=[] the largest storages are appended to it as (bytes, first path)."""
    import torch
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    seen, storages = set(), {}
    stack = [(r, f"root{i}") for i, r in enumerate(roots)]
    while stack:
        obj, path = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if DTensor and isinstance(obj, DTensor):
                stack.append((obj._local_tensor, path + "._local_tensor"))
            elif obj.device.type != "meta":
                try:
                    s = obj.untyped_storage()
                    if s.nbytes():
                        storages.setdefault((s.device.type, s.data_ptr()), (s.nbytes(), path))
                except (RuntimeError, NotImplementedError):
                    pass
            if obj.grad is not None:
                stack.append((obj.grad, path + ".grad"))
            continue
        if isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((k, path + "{key}"))
                stack.append((v, f"{path}[{k!r:.40}]"))
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
            continue
        mod = type(obj).__module__ or ""
        if mod.split(".")[0] in ("torch", "deepspeed", "zeroshard", "__main__", "gpt") and hasattr(obj, "__dict__"):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    if top is not None:
        top.extend(sorted(storages.values(), reverse=True)[:8])
    comm = sum(n for n, where in storages.values() if COMM_BUFFER_PATH.search(where))
    return sum(n for n, _ in storages.values()) - comm, comm


def _batch(data, step, rank, world, micro):
    import torch
    first = (step * world + rank) * micro
    return torch.stack([data[(first + i) % len(data)] for i in range(micro)])


def _ds_config(a, stage, extra=None):
    # gradient_clipping spelled out: DeepSpeed 0.19.3+ clips at 1.0 when it is left out, zeroshard
    # and the torch peers do not clip, so without it DeepSpeed alone pays for a norm and trains otherwise.
    return {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 100000,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.01,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": stage, **({"reduce_bucket_size": a.reduce_bucket_size}
                                                 if a.reduce_bucket_size else {}), **(extra or {})},
        "bf16": {"enabled": a.dtype == "bf16"},
    }


def _torch_adamw(params, a):
    import torch
    kw = {"lr": a.lr, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    if a.torch_adamw == "fused":
        kw["fused"] = True
    elif a.torch_adamw == "foreach":
        kw["foreach"] = True
    else:
        kw["foreach"] = False
    return torch.optim.AdamW(params, **kw)


def _memtrack():
    """The preloaded allocation counter (see bench/memtrack/memtrack.c), or None."""
    path = os.environ.get("ZERO_STEP_MEMTRACK")
    if not path:
        return None
    import ctypes
    lib = ctypes.CDLL(path)
    for name in ("memtrack_current", "memtrack_peak"):
        getattr(lib, name).restype = ctypes.c_long
    return lib


def build_memtrack(out_dir):
    """Compiles the allocation counter into out_dir; returns its path."""
    so = os.path.join(out_dir, "memtrack.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so,
                    os.path.join(HERE, "memtrack", "memtrack.c")], check=True)
    return so


def worker(a):
    import resource
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, ByteWindows, num_params, stdlib_text_bytes

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    impl = a.worker
    label, stage = IMPLS[impl]
    if impl.startswith("ds"):
        import deepspeed  # noqa: F401  (imported before the RSS baseline, like torch)
    elif impl.startswith("zs"):
        import zeroshard  # noqa: F401
    rss_start = _rss_now_bytes()
    heap = _memtrack()
    heap_start = heap.memtrack_current() if heap else 0
    result = {"impl": impl, "label": label, "stage": stage, "rank": rank}

    torch.manual_seed(1234)
    model = GPT(vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.d_model, n_layers=a.n_layers,
                n_heads=a.n_heads)
    result["params"] = num_params(model)
    data = ByteWindows(stdlib_text_bytes(), a.seq_len)
    roots = [model]
    zs_engine = None

    if impl.startswith("zs"):
        import zeroshard
        engine, opt, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                 config={**_ds_config(a, stage, ZS_EXTRA.get(impl)),
                                                         **TOP_EXTRA.get(impl, dict)()})
        zs_engine = engine
        roots = [engine, opt]
    elif impl.startswith("ds"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 config=_ds_config(a, stage))
        roots = [engine, opt]

    if impl.startswith(("zs", "ds")):
        # zeroshard and DeepSpeed share the engine API.
        def step_fn(batch, probe):
            loss = engine(batch)
            probe and probe()
            engine.backward(loss)
            probe and probe()
            engine.step()
            probe and probe()
            return loss
    else:
        if a.dtype != "fp32":
            raise ValueError(f"{impl}: only fp32 is set up for the torch peers")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if impl in ("ddp", "zero-r"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            wrapped = DDP(model, gradient_as_bucket_view=True)
            if impl == "ddp":
                opt = _torch_adamw(model.parameters(), a)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer
                kw = {"lr": a.lr, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
                if a.torch_adamw == "fused":
                    kw["fused"] = True
                else:
                    kw["foreach"] = a.torch_adamw == "foreach"
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        else:
            from torch.distributed.fsdp import fully_shard
            reshard = impl == "fsdp2-ra1"
            for blk in model.blocks:
                fully_shard(blk, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            wrapped = model
            opt = _torch_adamw(model.parameters(), a)
        roots = [wrapped, opt]

        def step_fn(batch, probe):
            loss = wrapped(batch)
            probe and probe()
            loss.backward()
            probe and probe()
            opt.step()
            opt.zero_grad(set_to_none=impl.startswith("fsdp2"))
            probe and probe()
            return loss

    # Where the peak RSS is reached: (phase, current RSS, peak RSS so far) after set-up and after
    # each phase of the warm-up steps.
    # With the heap counter: (phase, live bytes at its end, peak live bytes within it).
    def rss_mark(phase):
        rss_trace.append((phase, _rss_now_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        if heap:
            heap_trace.append((phase, heap.memtrack_current(), heap.memtrack_peak()))
            heap.memtrack_reset_peak()
    rss_trace, heap_trace = [], []
    rss_mark("set-up")
    if heap:
        heap_setup_peak = heap_trace[-1][2]

    # Warm-up; the last warm-up step samples the reachable model state after forward, after
    # backward and after the optimizer step, and keeps the largest.
    samples = []
    losses = []
    for s in range(a.warmup):
        batch = _batch(data, s, rank, world, a.micro)
        sample = s == a.warmup - 1

        phases = iter(("forward", "backward", "step"))

        def probe():
            rss_mark(f"{s}:{next(phases)}")
            if sample:
                top = []
                state, comm = reachable_tensor_bytes(roots, top)
                samples.append((state, comm, top))
        loss = step_fn(batch, probe)
        rss_mark(f"{s}:end")
        losses.append(float(loss.detach()))
    reach, reach_comm, top = max(samples, key=lambda x: x[0])

    times = []
    dist.barrier()
    for s in range(a.warmup, a.warmup + a.steps):
        batch = _batch(data, s, rank, world, a.micro)
        t0 = time.perf_counter()
        loss = step_fn(batch, None)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)

    if zs_engine is not None:
        peak = dict(zs_engine._core.memory.peak_bytes())
        result["zs_peak"] = peak
        result["zs_now"] = zs_engine.memory_bytes()
        result["model_state"] = sum(v for k, v in peak.items() if k != "comm_buffers")
        result["comm_buffers"] = peak.get("comm_buffers", 0)
    else:
        result["model_state"] = reach
        result["comm_buffers"] = reach_comm
    result["reachable"] = reach
    result["reachable_top"] = top
    result["times"] = t.tolist()
    result["losses"] = losses
    result["rss_start"] = rss_start
    result["rss_trace"] = rss_trace
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if heap:
        result["heap_start"] = heap_start
        result["heap_setup_peak"] = heap_setup_peak
        result["heap_train_peak"] = max([heap.memtrack_peak()] + [p for _, _, p in heap_trace[1:]])
        result["heap_trace"] = heap_trace
    with open(os.path.join(a.result_dir, f"{impl}.{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_impl(impl, a, result_dir, memtrack=None):
    python = a.ds_python if impl.startswith("ds") else sys.executable
    port = _free_port()
    worker_args = [python, os.path.abspath(__file__), "--worker", impl, "--result-dir", result_dir]
    for k in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "micro", "warmup", "steps", "dtype", "lr",
              "torch_adamw", "reduce_bucket_size"):
        worker_args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    procs, logs = [], []
    for rank in range(a.world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.world),
                   LOCAL_SIZE=str(a.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if memtrack:
            env.update(LD_PRELOAD=memtrack, ZERO_STEP_MEMTRACK=memtrack)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "examples"),
                                                        env.get("PYTHONPATH")) if p)
        log = open(os.path.join(result_dir, f"{impl}.{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(worker_args, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.time()
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1, a.timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            rcs.append("timeout")
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    wall = time.time() - t0
    files = [os.path.join(result_dir, f"{impl}.{r}.json") for r in range(a.world)]
    if all(os.path.exists(f) for f in files):
        ranks = [json.load(open(f)) for f in files]
        return {"impl": impl, "ok": True, "wall_s": wall, "ranks": ranks}
    tail = ""
    for log in logs:
        log.seek(0)
        tail += log.read()[-3000:]
    return {"impl": impl, "ok": False, "wall_s": wall, "rcs": rcs, "error": _error_line(tail),
            "log_tail": tail}


def _error_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    for l in reversed(lines):
        if ("Error" in l or "error" in l or "Exception" in l) and not l.startswith("  File"):
            return l.strip()[:400]
    return lines[-1][:400] if lines else "no output"


def summarize(res, a):
    label, stage = IMPLS[res["impl"]]
    row = {"impl": res["impl"], "label": label, "stage": stage, "ok": res["ok"]}
    if not res["ok"]:
        row["error"] = res["error"]
        return row
    r0 = res["ranks"][0]
    times = [x * 1e3 for x in r0["times"]]
    row.update(
        params=r0["params"],
        ms_median=statistics.median(times), ms_min=min(times), ms_max=max(times),
        tokens_per_s=a.world * a.micro * a.seq_len / (statistics.median(times) / 1e3),
        model_state_mb=max(r["model_state"] for r in res["ranks"]) / 1e6,
        reachable_mb=max(r["reachable"] for r in res["ranks"]) / 1e6,
        peak_rss_mb=max(r["peak_rss"] for r in res["ranks"]) / 1e6,
        rss_rise_mb=max(r["peak_rss"] - r["rss_start"] for r in res["ranks"]) / 1e6,
        comm_buffers_mb=max(r.get("comm_buffers", 0) for r in res["ranks"]) / 1e6,
        heap_peak_mb=max(max(r.get("heap_setup_peak", 0), r.get("heap_train_peak", 0))
                         for r in res["ranks"]) / 1e6,
        heap_rise_mb=max(max(r.get("heap_setup_peak", 0), r.get("heap_train_peak", 0))
                         - r.get("heap_start", 0) for r in res["ranks"]) / 1e6,
        heap_train_peak_mb=max(r.get("heap_train_peak", 0) for r in res["ranks"]) / 1e6,
        heap_setup_peak_mb=max(r.get("heap_setup_peak", 0) for r in res["ranks"]) / 1e6,
        loss_first=r0["losses"][0], loss_last=r0["losses"][-1], wall_s=res["wall_s"])
    row["reachable_top_mb"] = [(round(n / 1e6, 1), where) for n, where in r0["reachable_top"]]
    if "zs_peak" in r0:
        row["zs_peak"] = r0["zs_peak"]
    worst = max(res["ranks"], key=lambda r: r["peak_rss"])
    row["rss_trace_mb"] = [(phase, round(cur / 1e6), round(peak / 1e6))
                           for phase, cur, peak in worst.get("rss_trace", [])]
    worst = max(res["ranks"], key=lambda r: r.get("heap_train_peak", 0))
    row["heap_trace_mb"] = [(phase, round(cur / 1e6), round(peak / 1e6))
                            for phase, cur, peak in worst.get("heap_trace", [])]
    return row


def print_table(rows):
    hdr = ("| implementation | stage | ms/step median (min-max) | tokens/s | model state MB/rank "
           "(+comm buffers) | reachable MB | peak RSS MB (rise) | peak heap MB (rise) | loss first->last |")
    print(hdr)
    print("|" + "---|" * 9)
    for r in rows:
        if not r["ok"]:
            print(f"| {r['label']} | {r['stage']} | not run: {r['error']} | | | | | | |")
            continue
        heap = f"{r['heap_peak_mb']:.0f} ({r['heap_rise_mb']:.0f})" if r["heap_peak_mb"] else "not measured"
        print(f"| {r['label']} | {r['stage']} | {r['ms_median']:.0f} ({r['ms_min']:.0f}-{r['ms_max']:.0f}) "
              f"| {r['tokens_per_s']:.0f} | {r['model_state_mb']:.0f} (+{r['comm_buffers_mb']:.0f}) "
              f"| {r['reachable_mb']:.0f} "
              f"| {r['peak_rss_mb']:.0f} ({r['rss_rise_mb']:.0f}) | {heap} "
              f"| {r['loss_first']:.4f}->{r['loss_last']:.4f} |")
    print()
    by = {r["impl"]: r for r in rows if r["ok"]}
    for zs_impl, peer in PEER.items():
        zs, p = by.get(zs_impl), by.get(peer)
        if zs and p:
            print(f"stage {zs['stage']}: {zs['label']} / {p['label']}: time ratio {zs['ms_median'] / p['ms_median']:.2f}, "
                  f"model-state ratio {zs['model_state_mb'] / p['model_state_mb']:.2f}, "
                  f"peak RSS ratio {zs['peak_rss_mb'] / p['peak_rss_mb']:.2f}"
                  + (f", peak heap rise ratio {zs['heap_rise_mb'] / p['heap_rise_mb']:.2f}"
                     if p["heap_rise_mb"] else ""))
        ds = by.get(f"ds{zs_impl[2]}")
        if zs and ds:
            print(f"stage {zs['stage']}: {zs['label']} / DeepSpeed: time ratio {zs['ms_median'] / ds['ms_median']:.2f}, "
                  f"model-state ratio {zs['model_state_mb'] / ds['model_state_mb']:.2f}, "
                  f"peak RSS ratio {zs['peak_rss_mb'] / ds['peak_rss_mb']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--vocab", type=int, default=256,
                   help="vocabulary size (the data are bytes; a larger one only widens the "
                        "embedding and the head, e.g. 50257 for GPT-2's)")
    p.add_argument("--d-model", dest="d_model", type=int, default=768)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=14)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=12)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--micro", type=int, default=1, help="micro-batch (sequences) per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--torch-adamw", dest="torch_adamw", choices=["fused", "foreach", "forloop"],
                   default="fused", help="torch AdamW implementation of the torch peers")
    p.add_argument("--reduce-bucket-size", dest="reduce_bucket_size", type=int, default=0,
                   help="zero_optimization.reduce_bucket_size for zeroshard and DeepSpeed "
                        "(0: leave the default, 5e8 elements)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ds-python", dest="ds_python", default=DS_PYTHON_DEFAULT)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per implementation")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--no-heap", dest="heap", action="store_false",
                   help="do not preload the allocation counter (bench/memtrack)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", dest="result_dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero_step.") as d:
        memtrack = build_memtrack(d) if a.heap else None
        for impl in a.impls:
            t0 = time.time()
            res = run_impl(impl, a, d, memtrack)
            row = summarize(res, a)
            rows.append(row)
            status = (f"{row['ms_median']:.0f} ms/step" if row["ok"] else f"FAILED: {row['error']}")
            print(f"# {impl}: {status} ({time.time() - t0:.0f} s wall)", file=sys.stderr, flush=True)
            if not row["ok"] and os.environ.get("ZERO_STEP_VERBOSE"):
                print(res["log_tail"], file=sys.stderr)
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
