"""CPU offload benchmark (issue 19): zeroshard stages 2 and 3 with and without offload_optimizer /
offload_param "cpu", against DeepSpeed's ZeRO-Offload on its CPU accelerator, on the same ~100M GPT as
bench/zero_step.py (whose helpers it imports), world 2, CPU/Gloo, one thread per rank, each
implementation in its own pair of processes.

    python3 bench/offload.py                                  # everything, fp32, table on stdout
    python3 bench/offload.py --impls ds2-oo ds3-oo-op --tiny --steps 2 --json out.json

Step time: every rank times forward, backward and the optimizer step of each step; the per-step
maximum over ranks is kept for each phase and for the whole step, and the table shows medians of the
timed steps after the warm-up. zeroshard's step includes the gradient transfer and the host step;
where the engine reports them (`engine._core.last_step_times()`: transfer_ms, host_step_ms) they are
shown too. DeepSpeed runs with DS_ACCELERATOR=cpu and its config "optimizer" AdamW, which it turns into
DeepSpeedCPUAdam (its cpu_adam op, JIT-built on first use) when offload_optimizer is on.
Memory, per rank (maximum over the two ranks):
  zeroshard  the runtime's own accounting, peak per category: device = the categories without the
             `host_` prefix (comm_buffers shown apart), host = the `host_` categories.
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
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero_step import (DS_PYTHON_DEFAULT, ROOT, _batch, _ds_config, _error_line,  # noqa: E402
                       _free_port, reachable_tensor_bytes)

# name -> (label, stage, offload_optimizer to cpu, offload_param to cpu)
IMPLS = {
    "zs2": ("zeroshard", 2, False, False),
    "zs2-oo": ("zeroshard", 2, True, False),
    "ds2": ("DeepSpeed", 2, False, False),
    "ds2-oo": ("DeepSpeed", 2, True, False),
    "zs3": ("zeroshard", 3, False, False),
    "zs3-oo": ("zeroshard", 3, True, False),
    "zs3-oo-op": ("zeroshard", 3, True, True),
    "ds3": ("DeepSpeed", 3, False, False),
    "ds3-oo": ("DeepSpeed", 3, True, False),
    "ds3-oo-op": ("DeepSpeed", 3, True, True),
}
# DeepSpeed optimizer attributes that hold what ZeRO-Offload places on the offload device
# (stage_1_and_2.py / stage3.py, 0.19.8); "optimizer" is the inner DeepSpeedCPUAdam, whose
# param_groups are the fp32 partitions (with their .grad) and whose state holds the moments.
HOST_ROOTS = {"offload_optimizer": ("optimizer", "single_partition_of_fp32_groups",
                                    "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer",
                                    "param_buffer_of_bit16_for_cpu_offload_groups",
                                    "temp_grad_buffer_for_cpu_offload", "lp_grad_partitions_flat_pin_buffers"),
              "offload_param": ("fp16_partitioned_groups_flat", "lp_param_contiguous_pin_buffer")}
PHASES = ("forward", "backward", "step", "total")
HOST_STEP_KEYS = ("transfer_ms", "host_step_ms")


def offload_config(a, impl):
    _, stage, opt_off, param_off = IMPLS[impl]
    extra = {}
    if opt_off:
        extra["offload_optimizer"] = {"device": "cpu"}
    if param_off:
        extra["offload_param"] = {"device": "cpu"}
    return _ds_config(a, stage, extra)


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def _ds_split_bytes(model, engine, opt, impl):
    """(device, host, comm) bytes of DeepSpeed's model state, split by where offload puts it."""
    _, _, opt_off, param_off = IMPLS[impl]
    total, comm = reachable_tensor_bytes([engine, opt])
    names = (HOST_ROOTS["offload_optimizer"] if opt_off else ()) + (HOST_ROOTS["offload_param"] if param_off else ())
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
        sample = s == a.warmup - 1 and impl.startswith("ds")
        losses.append(train_step(s, sample and (lambda: samples.append(
            _ds_split_bytes(model, engine, opt, impl))))[0])
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
               "lr", "reduce_bucket_size")


def run_impl(impl, a, result_dir):
    """Runs impl's two ranks; returns their result dicts, or an error line and the log tails."""
    python = a.ds_python if impl.startswith("ds") else sys.executable
    argv = [python, os.path.abspath(__file__), "--worker", impl, "--result-dir", result_dir]
    for k in WORKER_ARGS:
        argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
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
    label, stage, opt_off, param_off = IMPLS[res["impl"]]
    offload = "+".join(n for n, on in (("optimizer", opt_off), ("param", param_off)) if on) or "none"
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
    if "zs_peak" in r0:
        row["zs_peak"] = r0["zs_peak"]
    return row


def print_table(rows):
    split = any("transfer_ms" in r for r in rows)
    cols = ["implementation", "stage", "offload", "forward ms", "backward ms", "step ms"]
    cols += ["transfer ms", "host step ms"] if split else []
    cols += ["total ms median (min-max)", "device MB/rank (+comm)", "host MB/rank", "peak RSS MB",
             "loss first->last"]
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
        cells += [f"{r['total_ms']:.0f} ({r['total_ms_min']:.0f}-{r['total_ms_max']:.0f})",
                  f"{r['device_mb']:.0f} (+{r['comm_mb']:.0f})", f"{r['host_mb']:.0f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['loss_first']:.4f}->{r['loss_last']:.4f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    by = {r["impl"]: r for r in rows if r["ok"]}
    for impl, r in by.items():
        if not (impl.startswith("zs") and "-" in impl):
            continue
        base, ds = by.get(impl.split("-")[0]), by.get("ds" + impl[2:])
        if base:  # target: at most 1.10
            print(f"{impl}: offload / no offload (stage {r['stage']}): total {r['total_ms'] / base['total_ms']:.2f}, "
                  f"step {r['step_ms'] / base['step_ms']:.2f}")
        if ds:  # target: DeepSpeed / zeroshard at least 1.5
            print(f"{impl}: DeepSpeed / zeroshard, same offload: total {ds['total_ms'] / r['total_ms']:.2f}, "
                  f"step {ds['step_ms'] / r['step_ms']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
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
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ds-python", dest="ds_python", default=DS_PYTHON_DEFAULT)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per implementation")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", dest="result_dir", default=None, help=argparse.SUPPRESS)
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
