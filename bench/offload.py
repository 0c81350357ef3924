"""CPU and NVMe offload benchmark (issues 19 and 20): zeroshard stages 2 and 3 with and without
offload_optimizer / offload_param "cpu", and stage 3 with offload_optimizer "nvme" (and offload_param
"nvme" too: "-nvme-op"), against DeepSpeed's
ZeRO-Offload / ZeRO-Infinity on its CPU accelerator, on the same ~100M GPT as bench/zero_step.py (whose
helpers it imports), world 2, CPU/Gloo, one thread per rank, each implementation in its own pair of
processes.

    python3 bench/offload.py                                  # CPU offload, fp32, table on stdout
    python3 bench/offload.py --impls ds2-oo ds3-oo-op --tiny --steps 2 --json out.json
    python3 bench/offload.py --impls zs3-oo zs3-nvme ds3-oo ds3-nvme --sub-group-size 10000000 \
        --ds-buffer-count 12                                  # issue 20's NVMe comparison
    python3 bench/offload.py --impls zs3-oo-op zs3-nvme-op ds3-oo-op ds3-nvme-op --dtype bf16 \
        --sub-group-size 10000000 --ds-buffer-count 12 --max-in-cpu 0 \
        --ds-param-buffer-count 128 --ds-param-buffer-size 2500000   # parameters on NVMe too

NVMe ("-nvme"): offload_optimizer {"device": "nvme", "nvme_path": a fresh directory made under
--nvme-dir for each run (removed after it), "pipeline_read"/"pipeline_write": true, "buffer_count":
--buffer-count}; with "-nvme-op" also offload_param {"device": "nvme", the same path, "max_in_cpu":
--max-in-cpu, buffer_count and buffer_size at DeepSpeed's defaults 5 and 1e8}; and DeepSpeed's default "aio" block (block_size 1 MiB, queue_depth 8,
intra_op_parallelism 1, single_submit false, overlap_events true) for both libraries. --sub-group-size
goes to every implementation of the run, so CPU and NVMe offload step the same sub-groups. "NVMe MB"
is the space the swap files take (st_blocks) under that directory after the warm-up, both ranks.
A zeroshard staging buffer holds one sub-group's master and state; a DeepSpeed one holds one tensor
(master, a moment or the gradient) of the largest sub-group, and its pipelined swapper holds up to
three sub-groups at once, so with Adam it needs buffer_count 12 (4 stops it at its first step, 8 at
its second): --ds-buffer-count 12 gives it the same staging bytes as zeroshard's 4. DeepSpeed keeps
in memory any tensor under max(1 MiB, block_size), so --tiny swaps nothing on its side.

Step time: every rank times forward, backward and the optimizer step of each step; the per-step
maximum over ranks is kept for each phase and for the whole step, and the table shows medians of the
timed steps after the warm-up. zeroshard's step includes the gradient transfer and the host step;
where the engine reports them (`engine._core.last_step_times()`: transfer_ms, host_step_ms, and
nvme_wait_ms, the part of transfer_ms spent waiting for NVMe reads and writes) they are shown too.
DeepSpeed runs with DS_ACCELERATOR=cpu and its config "optimizer" AdamW, which it turns into
DeepSpeedCPUAdam (its cpu_adam op, JIT-built on first use) when offload_optimizer is on.
Memory, per rank (maximum over the two ranks):
  zeroshard  the runtime's own accounting, peak per category from the last warm-up step on (the
             peaks are reset there, so set-up's transients, such as the master built on the host
             before it goes to NVMe, are left out; the whole run's peak is kept in the JSON as
             zs_run_peak): device = the categories without the `host_` prefix (comm_buffers shown
             apart), host = the `host_` categories (host_buffers holds the staging buffers).
  DeepSpeed  on its CPU accelerator every tensor is host memory, so the split is by where DeepSpeed
             puts it: host = the tensor storages reachable from what offload places on the offload
             device (HOST_ROOTS: the CPU optimizer with its fp32 partitions and state, the offload
             staging buffers, and with offload_param the parameter partitions); device = the rest of
             what is reachable from the engine and the optimizer (zero_step.reachable_tensor_bytes),
             its ipg gradient buckets shown apart as comm. Sampled after forward, backward and step
             of the last warm-up step; the largest sample of each is kept.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero_step import (DS_PYTHON_DEFAULT, ROOT, _batch, _ds_config, _error_line,  # noqa: E402
                       _free_port, reachable_tensor_bytes)

# name -> (label, stage, offload_optimizer device or None, offload_param device or None)
IMPLS = {
    "zs2": ("zeroshard", 2, None, None),
    "zs2-oo": ("zeroshard", 2, "cpu", None),
    "ds2": ("DeepSpeed", 2, None, None),
    "ds2-oo": ("DeepSpeed", 2, "cpu", None),
    "zs3": ("zeroshard", 3, None, None),
    "zs3-oo": ("zeroshard", 3, "cpu", None),
    "zs3-oo-op": ("zeroshard", 3, "cpu", "cpu"),
    "zs3-nvme": ("zeroshard", 3, "nvme", None),
    "zs3-nvme-op": ("zeroshard", 3, "nvme", "nvme"),
    "ds3": ("DeepSpeed", 3, None, None),
    "ds3-oo": ("DeepSpeed", 3, "cpu", None),
    "ds3-oo-op": ("DeepSpeed", 3, "cpu", "cpu"),
    "ds3-nvme": ("DeepSpeed", 3, "nvme", None),  # DeepSpeed swaps optimizer state at stage 3 only
    "ds3-nvme-op": ("DeepSpeed", 3, "nvme", "nvme"),
}
DEFAULT_IMPLS = [k for k in IMPLS if "-nvme" not in k]
# DeepSpeed's "aio" defaults (runtime/swap_tensor/constants.py, 0.19.8); zeroshard's are the same.
AIO_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True}
# DeepSpeed optimizer attributes that hold what ZeRO-Offload places on the offload device
# (stage_1_and_2.py / stage3.py, 0.19.8); "optimizer" is the inner DeepSpeedCPUAdam, whose
# param_groups are the fp32 partitions (with their .grad) and whose state holds the moments.
HOST_ROOTS = {"offload_optimizer": ("optimizer", "single_partition_of_fp32_groups",
                                    "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer",
                                    "param_buffer_of_bit16_for_cpu_offload_groups",
                                    "temp_grad_buffer_for_cpu_offload", "lp_grad_partitions_flat_pin_buffers"),
              "offload_param": ("fp16_partitioned_groups_flat", "lp_param_contiguous_pin_buffer"),
              # with "nvme": the swapper, whose buffer manager holds the staging buffers
              "nvme": ("optimizer_swapper",)}
PHASES = ("forward", "backward", "step", "total")
HOST_STEP_KEYS = ("transfer_ms", "host_step_ms", "nvme_wait_ms")


def offload_config(a, impl):
    _, stage, opt_dev, param_off = IMPLS[impl]
    extra = {"sub_group_size": a.sub_group_size} if a.sub_group_size else {}
    if opt_dev == "cpu":
        extra["offload_optimizer"] = {"device": "cpu"}
    elif opt_dev == "nvme":
        extra["offload_optimizer"] = {"device": "nvme", "nvme_path": a.nvme_path, "pipeline_read": True,
                                      "pipeline_write": True, "buffer_count": buffer_count(a, impl)}
    if param_off == "cpu":
        extra["offload_param"] = {"device": "cpu"}
    elif param_off == "nvme":
        extra["offload_param"] = {"device": "nvme", "nvme_path": a.nvme_path, "max_in_cpu": a.max_in_cpu}
        if impl.startswith("ds") and a.ds_param_buffer_count:  # see --ds-param-buffer-count
            extra["offload_param"].update({"buffer_count": a.ds_param_buffer_count,
                                           "buffer_size": a.ds_param_buffer_size})
    config = _ds_config(a, stage, extra)
    if "nvme" in (opt_dev, param_off):
        config["aio"] = dict(AIO_DEFAULTS)
    return config


def buffer_count(a, impl):
    """offload_optimizer.buffer_count: zeroshard counts sub-groups (master and state), DeepSpeed tensors."""
    return a.ds_buffer_count if impl.startswith("ds") and a.ds_buffer_count else a.buffer_count


def disk_bytes(path):
    """Bytes the files under path take on disk (allocated blocks)."""
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(d, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def _ds_split_bytes(model, engine, opt, impl):
    """(device, host, comm) bytes of DeepSpeed's model state, split by where offload puts it."""
    _, _, opt_dev, param_off = IMPLS[impl]
    total, comm = reachable_tensor_bytes([engine, opt])
    names = ((HOST_ROOTS["offload_optimizer"] if opt_dev else ()) + (HOST_ROOTS["nvme"] if opt_dev == "nvme" else ())
             + (HOST_ROOTS["offload_param"] if param_off else ()))
    host_roots = [getattr(opt, n) for n in names if getattr(opt, n, None) is not None]
    if param_off:
        host_roots += [p.ds_tensor for p in model.parameters() if getattr(p, "ds_tensor", None) is not None]
    host, _ = reachable_tensor_bytes(host_roots) if host_roots else (0, 0)
    return total - host, host, comm


def _zs_split_bytes(categories):
    host = sum(v for k, v in categories.items() if k.startswith("host_"))
    comm = categories.get("comm_buffers", 0)
    return sum(categories.values()) - host - comm, host, comm


def worker(a):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from gpt import GPT, ByteWindows, num_params, stdlib_text_bytes

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    impl = a.worker
    if impl.startswith("ds"):
        import deepspeed as lib
        lib.init_distributed(dist_backend="gloo")
    else:
        import zeroshard as lib
    torch.manual_seed(1234)
    model = GPT(vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.d_model, n_layers=a.n_layers,
                n_heads=a.n_heads)
    result = {"impl": impl, "rank": rank, "params": num_params(model)}
    data = ByteWindows(stdlib_text_bytes(), a.seq_len)
    engine, opt, _, _ = lib.initialize(model=model, model_parameters=model.parameters(),
                                       config=offload_config(a, impl))
    inner = getattr(opt, "optimizer", None)  # DeepSpeed's wrapped torch optimizer (its CPU Adam with offload)
    result["optimizer"] = type(opt).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    swapper = getattr(opt, "optimizer_swapper", None)  # DeepSpeed's, with offload_optimizer "nvme"
    result["optimizer"] += f"+{type(swapper).__name__}" if swapper is not None else ""
    step_times = getattr(getattr(engine, "_core", None), "last_step_times", None)

    def train_step(s, probe=None):
        t0 = time.perf_counter()
        loss = engine(_batch(data, s, rank, world, a.micro))
        t1 = time.perf_counter()
        probe and probe()
        engine.backward(loss)
        t2 = time.perf_counter()
        probe and probe()
        engine.step()
        t3 = time.perf_counter()
        probe and probe()
        row = [t1 - t0, t2 - t1, t3 - t2, t3 - t0]
        if step_times:
            extra = step_times()
            row += [extra[k] / 1e3 for k in HOST_STEP_KEYS]
        return float(loss.detach()), row

    losses, samples = [], []
    for s in range(a.warmup):
        if s == a.warmup - 1 and impl.startswith("zs"):  # the window DeepSpeed's samples cover
            result["zs_run_peak"] = dict(engine._core.memory.peak_bytes())
            engine._core.memory.reset_peaks()
        sample = s == a.warmup - 1 and impl.startswith("ds")
        losses.append(train_step(s, sample and (lambda: samples.append(
            _ds_split_bytes(model, engine, opt, impl))))[0])
    if a.nvme_path and rank == 0:
        result["nvme_bytes"] = disk_bytes(a.nvme_path)  # both ranks' files: they share the directory
    dist.barrier()
    rows = []
    for s in range(a.warmup, a.warmup + a.steps):
        loss, row = train_step(s)
        losses.append(loss)
        rows.append(row)
    t = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step and phase, the slowest rank

    if impl.startswith("zs"):
        peak = dict(engine._core.memory.peak_bytes())
        result["zs_peak"], result["zs_now"] = peak, engine.memory_bytes()
        result["zs_run_peak"] = {k: max(v, result.get("zs_run_peak", {}).get(k, 0)) for k, v in peak.items()}
        result["device"], result["host"], result["comm"] = _zs_split_bytes(peak)
    else:
        # the peak of each category over the samples, as zeroshard's accounting keeps it
        result["device"], result["host"], result["comm"] = [max(x) for x in zip(*samples)] or [0, 0, 0]
    result["columns"] = list(PHASES) + (list(HOST_STEP_KEYS) if step_times else [])
    result["times"] = t.tolist()
    result["losses"] = losses
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(a.result_dir, f"{impl}.{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

WORKER_ARGS = ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "micro", "warmup", "steps", "dtype",
               "lr", "reduce_bucket_size", "sub_group_size", "buffer_count", "ds_buffer_count", "max_in_cpu",
               "ds_param_buffer_count", "ds_param_buffer_size")


def run_impl(impl, a, result_dir):
    """Runs impl's two ranks; returns their result dicts, or an error line and the log tails."""
    python = a.ds_python if impl.startswith("ds") else sys.executable
    argv = [python, os.path.abspath(__file__), "--worker", impl, "--result-dir", result_dir]
    for k in WORKER_ARGS:
        argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    nvme_dir = None
    if "nvme" in IMPLS[impl][2:]:  # a fresh swap directory on the disk under test, removed after the run
        nvme_dir = tempfile.mkdtemp(prefix=f"{impl}.", dir=a.nvme_dir)
        argv += ["--nvme-path", nvme_dir]
    env = dict(os.environ, WORLD_SIZE=str(a.world), LOCAL_SIZE=str(a.world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, (os.path.join(ROOT, "examples"),
                                                        os.environ.get("PYTHONPATH")))))
    if impl.startswith("ds"):
        env.setdefault("DS_ACCELERATOR", "cpu")  # never CUDA, even on a GPU machine: this is the CPU path
    procs, logs = [], []
    for rank in range(a.world):
        logs.append(open(os.path.join(result_dir, f"{impl}.{rank}.log"), "w+"))
        procs.append(subprocess.Popen(argv, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      stdout=logs[-1], stderr=subprocess.STDOUT))
    deadline, rcs = time.time() + a.timeout, []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append("timeout")
    if nvme_dir:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    files = [os.path.join(result_dir, f"{impl}.{r}.json") for r in range(a.world)]
    # A rank that wrote its result and then failed at exit still measured; its exit code is kept.
    if all(os.path.exists(f) for f in files):
        return {"impl": impl, "ok": True, "rcs": rcs, "ranks": [json.load(open(f)) for f in files]}
    tail = ""
    for log in logs:
        log.seek(0)
        tail += log.read()[-3000:]
    return {"impl": impl, "ok": False, "rcs": rcs, "error": _error_line(tail), "log_tail": tail}


def measure(impl, a, result_dir):
    """Runs impl and returns its table row; one progress line on stderr (the log tail on failure)."""
    t0 = time.time()
    res = run_impl(impl, a, result_dir)
    row = summarize(res, a)
    done = f"{row['total_ms']:.0f} ms/step" if row["ok"] else f"FAILED: {row['error']}\n{res['log_tail']}"
    print(f"# {impl}: {time.time() - t0:.0f} s wall, exit codes {res['rcs']}: {done}", file=sys.stderr, flush=True)
    return row


def summarize(res, a):
    label, stage, opt_dev, param_off = IMPLS[res["impl"]]
    nvme = f" (nvme, buffer_count {buffer_count(a, res['impl'])})" if opt_dev == "nvme" else ""
    param = f" (nvme, max_in_cpu {a.max_in_cpu})" if param_off == "nvme" else ""
    offload = "+".join(n for n, on in (("optimizer" + nvme, opt_dev), ("param" + param, param_off)) if on) or "none"
    row = {"impl": res["impl"], "label": label, "stage": stage, "offload": offload, "ok": res["ok"],
           "rcs": res["rcs"]}
    if not res["ok"]:
        row["error"] = res["error"]
        return row
    r0 = res["ranks"][0]
    ms = {c: [step[i] * 1e3 for step in r0["times"]] for i, c in enumerate(r0["columns"])}
    # Phases are named bare ("forward"); the host-step keys carry their unit already.
    row.update({c if c.endswith("_ms") else f"{c}_ms": statistics.median(v) for c, v in ms.items()})
    row.update(params=r0["params"], optimizer=r0["optimizer"], total_ms_min=min(ms["total"]),
               total_ms_max=max(ms["total"]),
               tokens_per_s=a.world * a.micro * a.seq_len / (row["total_ms"] / 1e3),
               **{f"{k}_mb": max(r[k] for r in res["ranks"]) / 1e6 for k in ("device", "host", "comm",
                                                                             "peak_rss")},
               loss_first=r0["losses"][0], loss_last=r0["losses"][-1])
    for k in ("zs_peak", "zs_now", "zs_run_peak"):
        if k in r0:
            row[k] = r0[k]
    if "nvme_bytes" in r0:
        row["nvme_mb"] = r0["nvme_bytes"] / 1e6
    return row


def print_table(rows):
    split = any("transfer_ms" in r for r in rows)
    nvme = any("nvme_mb" in r for r in rows)
    cols = ["implementation", "stage", "offload", "forward ms", "backward ms", "step ms"]
    cols += ["transfer ms", "host step ms"] if split else []
    cols += ["NVMe wait ms"] if split and nvme else []
    cols += ["total ms median (min-max)", "device MB/rank (+comm)", "host MB/rank"]
    cols += ["NVMe MB (2 ranks)"] if nvme else []
    cols += ["peak RSS MB", "loss first->last"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        if not r["ok"]:
            print(f"| {r['label']} | {r['stage']} | {r['offload']} | not run: {r['error']} |"
                  + " |" * (len(cols) - 4))
            continue
        cells = [r["label"], r["stage"], r["offload"]] + [f"{r[k]:.0f}" for k in
                                                          ("forward_ms", "backward_ms", "step_ms")]
        if split:
            cells += [f"{r[k]:.0f}" if k in r else "" for k in ("transfer_ms", "host_step_ms")]
            cells += [f"{r['nvme_wait_ms']:.0f}" if "nvme_wait_ms" in r else ""] if nvme else []
        cells += [f"{r['total_ms']:.0f} ({r['total_ms_min']:.0f}-{r['total_ms_max']:.0f})",
                  f"{r['device_mb']:.0f} (+{r['comm_mb']:.0f})", f"{r['host_mb']:.0f}"]
        cells += [f"{r['nvme_mb']:.0f}" if "nvme_mb" in r else ""] if nvme else []
        cells += [f"{r['peak_rss_mb']:.0f}", f"{r['loss_first']:.4f}->{r['loss_last']:.4f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    by = {r["impl"]: r for r in rows if r["ok"]}
    for impl, r in by.items():
        if not (impl.startswith("zs") and "-" in impl):
            continue
        nvme = "-nvme" in impl
        # targets: CPU offload / none at most 1.10 (issue 19), NVMe / CPU offload at most 1.2 (issue 20)
        base, what = ((by.get(impl.replace("-nvme", "-oo")), "NVMe / CPU offload") if nvme
                      else (by.get(impl.split("-")[0]), "offload / no offload"))
        if base:
            print(f"{impl}: {what} (stage {r['stage']}): total {r['total_ms'] / base['total_ms']:.2f}, "
                  f"step {r['step_ms'] / base['step_ms']:.2f}")
        ds = by.get("ds" + impl[2:])
        if ds:  # targets: DeepSpeed / zeroshard at least 1.5 (issue 19), above 1 with NVMe (issue 20)
            print(f"{impl}: DeepSpeed / zeroshard, same offload: total {ds['total_ms'] / r['total_ms']:.2f}, "
                  f"step {ds['step_ms'] / r['step_ms']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=list(IMPLS),
                   help="default: every implementation but the -nvme ones")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", dest="d_model", type=int, default=768)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=14)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=12)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--tiny", action="store_true",
                   help="a 0.1M GPT (d_model 64, 2 layers, 4 heads, seq_len 32) to check the script")
    p.add_argument("--micro", type=int, default=2, help="micro-batch (sequences) per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reduce-bucket-size", dest="reduce_bucket_size", type=int, default=0,
                   help="zero_optimization.reduce_bucket_size (0: leave the default, 5e8 elements)")
    p.add_argument("--sub-group-size", dest="sub_group_size", type=int, default=0,
                   help="zero_optimization.sub_group_size for every implementation (0: leave the default, 1e9)")
    p.add_argument("--nvme-dir", dest="nvme_dir", default=tempfile.gettempdir(),
                   help="where each -nvme run makes its fresh swap directory (a real disk, not tmpfs)")
    p.add_argument("--buffer-count", dest="buffer_count", type=int, default=4,
                   help="offload_optimizer.buffer_count of the -nvme runs")
    p.add_argument("--ds-buffer-count", dest="ds_buffer_count", type=int, default=0,
                   help="DeepSpeed's buffer_count where it differs (0: --buffer-count); DeepSpeed's buffers "
                        "hold one tensor each (master, a moment or the gradient), zeroshard's a whole sub-group")
    p.add_argument("--max-in-cpu", dest="max_in_cpu", type=int, default=0,
                   help="offload_param.max_in_cpu of the -nvme-op runs (0: every chunk goes back to disk after use)")
    p.add_argument("--ds-param-buffer-count", dest="ds_param_buffer_count", type=int, default=0,
                   help="DeepSpeed's offload_param.buffer_count in the -nvme-op runs (0: its default 5). Its "
                        "parameter swapper takes one buffer per parameter swapped in, the prefetched ones "
                        "included, so the default stops it on a 100M GPT ('Not enough buffers')")
    p.add_argument("--ds-param-buffer-size", dest="ds_param_buffer_size", type=int, default=100000000,
                   help="DeepSpeed's offload_param.buffer_size (elements) where --ds-param-buffer-count is given")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ds-python", dest="ds_python", default=DS_PYTHON_DEFAULT)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per implementation")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", dest="result_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--nvme-path", dest="nvme_path", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.d_model, a.n_layers, a.n_heads, a.seq_len = 64, 2, 4, 32
    if a.worker:
        worker(a)
        return
    with tempfile.TemporaryDirectory(prefix="offload.") as d:
        rows = [measure(impl, a, d) for impl in a.impls]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
