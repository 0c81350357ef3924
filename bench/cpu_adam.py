"""CPU optimizer step: zeroshard vs DeepSpeedCPUAdam vs torch.optim.AdamW, and the memory ceiling,
in one run (issue 4). Prints a markdown table (median of --reps timed steps after one warm-up).

  fp32 step      flat fp32 p, g, m, v; AdamW (wd 0.01); 28 B/param moved in place
  offload step   bf16 gradients -> bf16 parameters with loss-scale unscaling and clipping by the
                 global norm; zeroshard: grad_stats (one read of bf16 grads) + the fused Adam pass;
                 DeepSpeed: grads cast into the fp32 buffer, inf/nan check, norm, unscale+clip,
                 DeepSpeedCPUAdam.step, cast of the parameters back to bf16
  ceiling        bench/ceiling/adam28.cpp, the same in-place 28 B/param with -march=native

Run with the interpreter that has deepspeed (the zeroshard editable install must be visible):
  OMP_NUM_THREADS=2 python bench/cpu_adam.py --sizes 100e6 1e9 --offload-sizes 100e6 500e6
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import torch

from zeroshard import _C

K = _C.kernels
HERE = os.path.dirname(os.path.abspath(__file__))
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LOSS_SCALE, MAX_NORM = 1024.0, 1.0


def timed(fn, reps):
    fn()   # warm-up: first-touch page faults, JIT, state allocation
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts), max(ts)


ROWS = []


def row(section, n, name, t, bytes_per_param, note=""):
    med, lo, hi = t
    ROWS.append((section, n, name, med, lo, hi, n / med / 1e9, bytes_per_param * n / med / 1e9, note))
    print(f"| {section} | {n/1e6:.0f}M | {name} | {med*1e3:.1f} ({lo*1e3:.0f}-{hi*1e3:.0f}) | "
          f"{n/med/1e9:.3f} | {bytes_per_param*n/med/1e9:.1f} | {note} |", flush=True)


def ceiling(n, reps):
    exe = os.path.join("/tmp", "zs_adam28")
    src = os.path.join(HERE, "ceiling", "adam28.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["g++", "-O3", "-march=native", "-fno-math-errno", "-fopenmp", src, "-o", exe],
                       check=True)
    out = subprocess.run([exe, str(n), str(reps)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts[0] in ("traffic28", "adam28"):
            s = float(parts[1])
            row("ceiling", n, f"C++ {parts[0]} (-march=native)", (s, s, s), 28, "median inside the binary")


def fp32_section(n, reps, ds_cls, skip_foreach):
    p = torch.nn.Parameter(torch.randn(n))
    g = torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        K.adam_step(p.data, g, m, v, LR, *BETAS, EPS, WD, True, True, step[0])
    row("fp32 step", n, f"zeroshard ({K.cpu_isa()})", timed(ours, reps), 28)
    del m, v
    gc.collect()

    p.grad = g
    if ds_cls is not None:
        opt = ds_cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        row("fp32 step", n, "DeepSpeedCPUAdam", timed(opt.step, reps), 28)
        del opt
        gc.collect()
    for kind in ("foreach", "fused"):
        if kind == "foreach" and skip_foreach:
            print(f"| fp32 step | {n/1e6:.0f}M | torch AdamW foreach | skipped | | | "
                  "its temporaries would not fit in RAM next to the state |")
            continue
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                **{kind: True})
        row("fp32 step", n, f"torch AdamW {kind}", timed(opt.step, reps), 28)
        del opt
        gc.collect()


def offload_section(n, reps, ds_cls):
    """bf16 grads in, bf16 params out, unscale + clip. Minimal traffic: read g16 twice (norm pass
    and update pass) + 28 B fp32 in-place Adam + write p16 = 32 B/param."""
    p32 = torch.randn(n)
    g16 = (torch.randn(n) * LOSS_SCALE * 1e-4).to(torch.bfloat16)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        sum_sq, finite = K.grad_stats(g16)
        if not finite:
            return
        norm = sum_sq ** 0.5 / LOSS_SCALE
        clip = min(1.0, MAX_NORM / (norm + 1e-6))
        step[0] += 1
        K.adam_step(p32, g16, m, v, LR, *BETAS, EPS, WD, True, True, step[0], param16=p16,
                    grad_scale=clip / LOSS_SCALE)
    row("offload step", n, "zeroshard fused", timed(ours, reps), 32)
    del m, v
    gc.collect()
    if ds_cls is None:
        return
    param = torch.nn.Parameter(p32)
    param.grad = torch.empty(n)          # DeepSpeed's fp32 gradient partition buffer
    opt = ds_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)

    def deepspeed_sequence():
        g32 = param.grad
        g32.copy_(g16)                                   # cast bf16 -> fp32 partition
        s = float(g32.sum())                             # DeepSpeed's inf/nan check
        if s in (float("inf"), float("-inf")) or s != s:
            return
        norm = float(g32.norm(2)) / LOSS_SCALE           # global norm
        clip = min(1.0, MAX_NORM / (norm + 1e-6))
        g32.mul_(clip / LOSS_SCALE)                      # unscale + clip
        opt.step()                                       # DeepSpeedCPUAdam (fp32)
        p16.copy_(param.data)                            # cast parameters back to bf16
    row("offload step", n, "DeepSpeed sequence", timed(deepspeed_sequence, reps), 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=float, default=[100e6, 1e9])
    ap.add_argument("--offload-sizes", nargs="+", type=float, default=[100e6, 500e6])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-foreach-above", type=float, default=600e6,
                    help="skip torch foreach above this size (n-sized temporaries)")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    torch.set_num_threads(threads)
    ds_cls = None
    try:
        t = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])   # JIT build or load of cpu_adam
        print(f"DeepSpeed import + cpu_adam load/build: {time.perf_counter() - t:.1f} s")
        ds_cls = DeepSpeedCPUAdam
    except Exception as e:   # report, do not hide: the table then lacks the DeepSpeed rows
        print(f"DeepSpeed unavailable: {type(e).__name__}: {e}")
    print(f"torch {torch.__version__}, threads {threads}, zeroshard ISA {K.cpu_isa()} "
          f"(cpu_threads {K.cpu_threads()})")
    print("| section | params | implementation | ms median (min-max) | Gparam/s | GB/s | note |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        n = int(n)
        ceiling(n, args.reps)
        fp32_section(n, args.reps, ds_cls, skip_foreach=n > args.no_foreach_above)
        gc.collect()
    for n in args.offload_sizes:
        offload_section(int(n), args.reps, ds_cls)
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
