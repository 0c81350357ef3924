"""Checkpoint benchmark (issue 18): save and load seconds and GB/s of zeroshard, DeepSpeed and torch
DCP + FSDP2 on the same ~113M-parameter GPT (fp32, AdamW), world 2, CPU/Gloo, each implementation in
its own pair of processes, next to the disk's sequential write and read bandwidth measured in the
same run; then consolidation (zeroshard-consolidate vs DeepSpeed's zero_to_fp32.py): time and peak
RSS.

    python3 bench/checkpoint.py                        # everything, table on stdout
    python3 bench/checkpoint.py --impls zs3 dcp --json out.json

Each implementation trains one step (so the optimizer state exists), then, timed between barriers:
  save      the library's own call (zeroshard save_checkpoint, DeepSpeed save_checkpoint, DCP
            get_state_dict + dcp.save); then rank 0 fsyncs every file and directory of the
            checkpoint (timed apart: DeepSpeed's torch.save does not fsync; zeroshard and DCP do, so
            their part is near zero). GB/s = the checkpoint's bytes on disk / (save + fsync).
  load      after every rank's state was overwritten and the page cache dropped
            (echo 3 > /proc/sys/vm/drop_caches; the table says when that was not permitted): the
            library's own load (DCP: get_state_dict + dcp.load + set_state_dict). Verified: each
            rank's local weights and optimizer state hash the same as before the save ("ok").
Disk: one writer (4 MiB writes, then fsync) and two writers in parallel (as two ranks write) of
the zeroshard checkpoint's size; each read back, one and two readers, after dropping the cache;
before and after the implementations run. "% disk" is against the best of these four.
Consolidation: each command in a fresh process, page cache dropped first; peak RSS is that
process's ru_maxrss (os.wait4). zeroshard-consolidate also runs on DeepSpeed's checkpoint, and its
output is compared tensor by tensor with zero_to_fp32.py's on that same checkpoint.
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DS_PYTHON_DEFAULT = "/tmp/ds-venv/bin/python"

# name -> (label, ZeRO stage or its equivalent)
IMPLS = {
    "zs3": ("zeroshard", 3),
    "ds3": ("DeepSpeed 0.19.8", 3),
    "dcp": ("torch DCP + FSDP2 fully_shard", 3),
    "zs2": ("zeroshard", 2),
    "ds2": ("DeepSpeed 0.19.8", 2),
    "zs1": ("zeroshard", 1),
    "ds1": ("DeepSpeed 0.19.8", 1),
}
DEFAULT_IMPLS = ["zs3", "ds3", "dcp", "zs1", "ds1"]
BLOCK_BYTES = 4 << 20
DS_CONSOLIDATE = ("import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict "
                  "as convert; convert(sys.argv[1], sys.argv[2], max_shard_size=None)")


# ----------------------------------------------------------------------------------------------
# shared
# ----------------------------------------------------------------------------------------------

def drop_page_cache():
    """True when the kernel's page cache was dropped (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def fsync_tree(path):
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def _state_tensors(impl, engine, opt, model):
    """This rank's weights and optimizer state as live tensors (what a load must restore)."""
    import torch
    if impl.startswith("zs"):
        return [values for _, _, _, values, _ in engine._core.shard_entries(True)]
    inner = opt.optimizer if impl.startswith("ds") else opt  # DeepSpeed's flat fp32 partitions
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            for t in [p] + [v for v in inner.state[p].values() if isinstance(v, torch.Tensor)]:
                out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def _hash(tensors):
    import torch
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def worker(a):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, num_params

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    impl, (_, stage) = a.worker, IMPLS[a.worker]
    ckpt = os.path.join(a.ckpt_dir, impl)
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=a.seq_len, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads)
    result = {"impl": impl, "rank": rank, "params": num_params(model)}
    adamw = {"lr": 1e-4, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    ds_like = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "steps_per_print": 10**9, "zero_optimization": {"stage": stage}}  # DeepSpeed 0.19.3+ clips if unset
    engine = opt = None
    if impl.startswith("zs"):
        import zeroshard
        cfg = dict(ds_like, optimizer={"type": "AdamW", "params": {**adamw, "betas": list(adamw["betas"])}})
        engine, opt, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    elif impl.startswith("ds"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        client = torch.optim.AdamW(model.parameters(), **adamw)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                                 config=dict(ds_like, zero_force_ds_cpu_optimizer=False))
    else:
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 256, (1, a.seq_len + 1), generator=g)
    if engine is not None:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    else:
        model(batch).backward()
        opt.step()
        opt.zero_grad()

    def save():
        if impl == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        else:
            engine.save_checkpoint(ckpt, tag="bench")

    def load():
        if impl == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            path, _ = engine.load_checkpoint(ckpt, tag="bench")
            assert path is not None, f"{impl}: load_checkpoint found nothing in {ckpt}"

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    tensors = _state_tensors(impl, engine, opt, model)
    before = _hash(tensors)
    os.sync()  # nothing of earlier work left dirty to be flushed inside the timed save
    result["save_s"] = timed(save)
    if rank == 0:
        t0 = time.perf_counter()
        fsync_tree(ckpt)
        result["fsync_s"] = time.perf_counter() - t0
        result["bytes"] = tree_bytes(ckpt)
    with torch.no_grad():
        for t in tensors:
            t.fill_(0.25)
    dist.barrier()
    result["cache_dropped"] = drop_page_cache() if rank == 0 else None
    result["load_s"] = timed(load)
    result["restored"] = _hash(_state_tensors(impl, engine, opt, model)) == before
    if impl == "zs3" and a.param_hashes:
        # The whole fp32 weights, to check zeroshard-consolidate's output against (gathers).
        from zeroshard.utils import safe_get_full_fp32_param
        hashes = {n: _hash([safe_get_full_fp32_param(p)]) for n, p in model.named_parameters()}
        if rank == 0:
            result["param_hashes"] = hashes
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


def run_impl(impl, a, ckpt_dir, result_dir):
    python = a.ds_python if impl.startswith("ds") else sys.executable
    port = _free_port()
    args = [python, os.path.abspath(__file__), "--worker", impl, "--result-dir", result_dir,
            "--ckpt-dir", ckpt_dir, "--d-model", str(a.d_model), "--n-layers", str(a.n_layers),
            "--n-heads", str(a.n_heads), "--seq-len", str(a.seq_len)] + (["--param-hashes"] if a.param_hashes else [])
    procs, logs = [], []
    for rank in range(a.world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.world),
                   LOCAL_SIZE=str(a.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
        log = open(os.path.join(result_dir, f"{impl}.{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.time()
    for p in procs:
        try:
            p.wait(timeout=max(1, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    files = [os.path.join(result_dir, f"{impl}.{r}.json") for r in range(a.world)]
    if all(os.path.exists(f) for f in files):
        ranks = [json.load(open(f)) for f in files]
        r0 = ranks[0]
        return {"impl": impl, "label": IMPLS[impl][0], "stage": IMPLS[impl][1], "ok": True,
                "params": r0["params"], "bytes": r0["bytes"], "save_s": r0["save_s"], "fsync_s": r0["fsync_s"],
                "load_s": r0["load_s"], "cache_dropped": r0["cache_dropped"],
                "restored": all(r["restored"] for r in ranks), "param_hashes": r0.get("param_hashes")}
    logs[0].seek(0)
    tail = [l.strip() for l in logs[0].read().splitlines() if l.strip()][-3:]
    return {"impl": impl, "label": IMPLS[impl][0], "stage": IMPLS[impl][1], "ok": False,
            "error": " / ".join(tail)[-500:]}


def disk_bandwidth(directory, total_bytes, streams):
    """(write GB/s, read GB/s, cache dropped): `streams` threads each write then read
    total_bytes/streams sequentially in 4 MiB blocks; writes end with fsync."""
    block = os.urandom(BLOCK_BYTES)
    each = max(1, total_bytes // streams // BLOCK_BYTES)
    paths = [os.path.join(directory, f"disk-{streams}-{i}.bin") for i in range(streams)]

    def write(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(each):
            os.write(fd, block)
        os.fsync(fd)
        os.close(fd)

    def read(path):
        fd = os.open(path, os.O_RDONLY)
        while os.read(fd, BLOCK_BYTES):
            pass
        os.close(fd)

    def run(fn):
        threads = [threading.Thread(target=fn, args=(p,)) for p in paths]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    os.sync()
    nbytes = each * BLOCK_BYTES * streams
    write_s = run(write)
    dropped = drop_page_cache()
    read_s = run(read)
    for p in paths:
        os.remove(p)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9, dropped


def measured_process(cmd, log_path, env=None):
    """(seconds, peak RSS bytes, exit code) of one process, its own ru_maxrss from wait4."""
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss * 1024, p.returncode


def consolidate(a, runs, work):
    """Rows for zeroshard-consolidate and zero_to_fp32.py, with their outputs checked."""
    from safetensors.torch import load_file
    import torch
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = []
    if "zs3" in runs:
        jobs.append(("zeroshard-consolidate", "zeroshard ZeRO-3", "zs3",
                     [sys.executable, "-m", "zeroshard.utils.zero_to_fp32", "--quiet"]))
    if "ds3" in runs:
        jobs.append(("zeroshard-consolidate", "DeepSpeed ZeRO-3", "ds3",
                     [sys.executable, "-m", "zeroshard.utils.zero_to_fp32", "--quiet"]))
        # zero_to_fp32.py's command line always shards (--max_shard_size defaults to 5GB), which
        # imports huggingface_hub, absent from the DeepSpeed venv; its function with
        # max_shard_size=None writes the one file this model needs. In its default format,
        # pytorch_model.bin: its safetensors output refuses the GPT's tied embedding.
        jobs.append(("DeepSpeed zero_to_fp32.py", "DeepSpeed ZeRO-3", "ds3", [a.ds_python, "-c", DS_CONSOLIDATE]))
    # What each tool's interpreter holds before reading anything: its imports.
    baselines = {"zeroshard-consolidate": [sys.executable, "-c", "import zeroshard.utils.zero_to_fp32"],
                 "DeepSpeed zero_to_fp32.py": [a.ds_python, "-c", "import deepspeed.utils.zero_to_fp32"]}
    import_rss = {tool: measured_process(cmd, os.path.join(work, "results", "imports.log"), env)[1]
                  for tool, cmd in baselines.items()}
    for tool, source, impl, cmd in jobs:
        ckpt, out = os.path.join(work, "ckpt", impl), os.path.join(work, "out", f"{impl}-{len(rows)}")
        dropped = drop_page_cache()
        log = os.path.join(work, "results", f"consolidate-{len(rows)}.log")
        seconds, rss, rc = measured_process(cmd + [ckpt, out], log, env)
        row = {"tool": tool, "checkpoint": source, "command": " ".join(cmd + ["CKPT", "OUT"]), "seconds": seconds,
               "peak_rss": rss, "import_rss": import_rss[tool], "rc": rc, "cache_dropped": dropped, "out": out}
        if rc == 0:
            row["out_bytes"] = tree_bytes(out)
        else:
            with open(log) as f:
                row["error"] = " / ".join(l.strip() for l in f.read().splitlines()[-3:])[-400:]
        rows.append(row)
    # Verify: zeroshard's output of its own checkpoint holds the trained weights; on DeepSpeed's
    # checkpoint, it equals zero_to_fp32.py's output tensor by tensor.
    def tensors_of(out):
        found = {}
        for name in sorted(os.listdir(out)):
            path = os.path.join(out, name)
            if name.endswith(".safetensors"):
                found.update(load_file(path))
            elif name.endswith(".bin"):
                found.update(torch.load(path, weights_only=True))
        return found
    hashes = runs.get("zs3", {}).get("param_hashes")
    for row in rows:
        if row["rc"] != 0:
            row["check"] = "failed (see its log)"
        elif row["checkpoint"].startswith("zeroshard") and hashes:
            got = tensors_of(row["out"])
            bad = [n for n, h in hashes.items() if n not in got or _hash([got[n].float()]) != h]
            row["check"] = "equals the engine's weights" if not bad else f"differs: {bad[:3]}"
        elif row["checkpoint"].startswith("zeroshard"):
            row["check"] = "not checked (run without --param-hashes)"
    zs_ds = [r for r in rows if r["checkpoint"].startswith("DeepSpeed") and r["rc"] == 0]
    if len(zs_ds) == 2:
        x, y = (tensors_of(r["out"]) for r in zs_ds)
        common = set(x) & set(y)
        bad = [n for n in common if not torch.equal(x[n].float(), y[n].float())]
        verdict = (f"{len(common)} tensors equal" if not bad else f"{len(bad)} of {len(common)} differ: {bad[:3]}")
        only = sorted(set(x) ^ set(y))
        if only:
            verdict += f"; in one output only: {only[:4]}"
        for r in zs_ds:
            r["check"] = "vs the other tool: " + verdict
    for r in rows:
        shutil.rmtree(r.pop("out"), ignore_errors=True)
    return rows


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")) / 1e6
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gb": round(mem, 1), "kernel": platform.release(),
            "loadavg": open("/proc/loadavg").read().split()[:3]}


def filesystem_of(path):
    best = ("?", "?", "?")
    for line in open("/proc/mounts"):
        dev, mnt, fstype = line.split()[:3]
        if path == mnt or path.startswith(mnt.rstrip("/") + "/"):
            if len(mnt) >= len(best[1]) or best[1] == "?":
                best = (dev, mnt, fstype)
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def print_tables(report):
    disk = report["disk"]
    print(f"disk ({report['fs']['device']} {report['fs']['fstype']} at {report['fs']['mount']}), "
          f"{disk['bytes'] / 1e9:.2f} GB in 4 MiB blocks, before and after the implementations ran:")
    for when in ("before", "after"):
        (w1, r1, d1), (w2, r2, d2) = disk[when]
        print(f"  {when}: write + fsync {w1:.2f} GB/s (1 stream), {w2:.2f} GB/s (2 streams); read {r1:.2f} / "
              f"{r2:.2f} GB/s (page cache dropped: {d1 and d2})")
    wref = max(w for when in ("before", "after") for w, _, _ in disk[when])
    rref = max(r for when in ("before", "after") for _, r, _ in disk[when])
    print(f"  % disk below: of the best of these, write {wref:.2f} GB/s, read {rref:.2f} GB/s")
    print()
    print("| implementation | stage | checkpoint GB | save s (+fsync s) | save GB/s | % disk write "
          "| load s | load GB/s | % disk read | restored |")
    print("|" + "---|" * 10)
    for r in report["runs"].values():
        if not r["ok"]:
            print(f"| {r['label']} | {r['stage']} | not run: {r['error']} |||||||")
            continue
        gb = r["bytes"] / 1e9
        save = r["save_s"] + r["fsync_s"]
        cold = "" if r["cache_dropped"] else " (cache not dropped)"
        print(f"| {r['label']} | {r['stage']} | {gb:.3f} | {r['save_s']:.2f} (+{r['fsync_s']:.2f}) "
              f"| {gb / save:.2f} | {100 * gb / save / wref:.0f} % | {r['load_s']:.2f}{cold} | {gb / r['load_s']:.2f} "
              f"| {100 * gb / r['load_s'] / rref:.0f} % | {'ok' if r['restored'] else 'WRONG'} |")
    if report.get("consolidation"):
        print()
        print("| tool | checkpoint | seconds | output GB/s | peak RSS MB | RSS of its imports alone MB | check |")
        print("|---|---|---|---|---|---|---|")
        for c in report["consolidation"]:
            if c["rc"] != 0:
                print(f"| {c['tool']} | {c['checkpoint']} | failed (exit {c['rc']}): {c['error']} | | | | |")
                continue
            print(f"| {c['tool']} | {c['checkpoint']} | {c['seconds']:.2f} | {c['out_bytes'] / c['seconds'] / 1e9:.2f} "
                  f"| {c['peak_rss'] / 1e6:.0f} | {c['import_rss'] / 1e6:.0f} | {c.get('check', '')} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=list(IMPLS))
    p.add_argument("--d-model", dest="d_model", type=int, default=768)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=16)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=12)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a new folder in /tmp)")
    p.add_argument("--ds-python", dest="ds_python", default=DS_PYTHON_DEFAULT)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per implementation")
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", dest="result_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", dest="ckpt_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--param-hashes", dest="param_hashes", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    a.param_hashes = a.consolidate
    work = tempfile.mkdtemp(prefix="zs-ckpt-bench-", dir=a.dir or "/tmp")
    for sub in ("ckpt", "results", "out"):
        os.makedirs(os.path.join(work, sub))
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
              "fs": filesystem_of(os.path.realpath(work)), "model": {"d_model": a.d_model, "n_layers": a.n_layers,
                                                                     "seq_len": a.seq_len, "dtype": "fp32"}}
    try:
        # The disk at the size of a zeroshard checkpoint: 12 bytes a parameter (fp32 weights, 2 moments).
        params = 256 * a.d_model + a.seq_len * a.d_model + a.n_layers * (12 * a.d_model ** 2 + 13 * a.d_model) \
            + 2 * a.d_model
        size = 12 * params
        report["disk"] = {"bytes": size, "before": [disk_bandwidth(work, size, n) for n in (1, 2)]}
        report["runs"] = {}
        for impl in a.impls:
            print(f"running {impl} ...", file=sys.stderr, flush=True)
            report["runs"][impl] = run_impl(impl, a, os.path.join(work, "ckpt"), os.path.join(work, "results"))
            if impl not in ("zs3", "ds3") or not a.consolidate:
                shutil.rmtree(os.path.join(work, "ckpt", impl), ignore_errors=True)
        report["disk"]["after"] = [disk_bandwidth(work, size, n) for n in (1, 2)]
        if a.consolidate:
            print("consolidating ...", file=sys.stderr, flush=True)
            ok = {k: v for k, v in report["runs"].items() if v["ok"]}
            report["consolidation"] = consolidate(a, ok, work)
        report["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in report["runs"].values():
        r.pop("param_hashes", None)
    m = report["machine"]
    print(f"{report['command']}\n{m['cpu']}, {m['cores']} cores, {m['mem_gb']} GB, Linux {m['kernel']}; "
          f"load average {' '.join(m['loadavg'])} before, {' '.join(report['loadavg_after'])} after; model "
          f"{next(iter(report['runs'].values())).get('params', 0) / 1e6:.1f}M parameters, fp32\n")
    print_tables(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
