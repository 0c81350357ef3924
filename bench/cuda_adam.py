"""The CUDA fused Adam step (kernels/cuda/optimizers.cu through _C.kernels.adam_step) against
torch.optim.AdamW(fused=True) and foreach on one GPU, and the device's copy bandwidth measured in
the same run. Needs a GPU; prints a markdown table (median of --reps timed steps after warm-up,
CUDA events).

  fp32 step    flat fp32 p, g, m, v; AdamW (wd 0.01): 28 B/param moved in place
  bf16 step    bf16 gradients, loss-scale unscale, fp32 master + moments, bf16 copy written:
               2 + 16 + 8 + 2 = 28 B/param for zeroshard's one pass; torch has no fused form of
               this (its rows cast the gradient first and the parameters after)

    python3 bench/cuda_adam.py --sizes 100e6 1e9
"""
import argparse
import statistics

import torch

from zeroshard import _C

K = _C.kernels
LR, BETAS, EPS, WD, SCALE = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1024.0


def timed(fn, reps):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def row(section, n, name, t, bytes_per_param):
    print(f"| {section} | {n / 1e6:.0f}M | {name} | {t * 1e3:.2f} | {bytes_per_param * n / t / 1e9:.0f} |",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=float, default=[100e6, 1e9])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| section | params | implementation | ms (median) | GB/s at the stated bytes/param |")
    print("|---|---|---|---|---|")
    for n in (int(s) for s in a.sizes):
        copy_row(n, a.reps)
        adam_rows(n, a.reps)
        torch.cuda.empty_cache()


def copy_row(n, reps):
    src = torch.empty(n, device="cuda")
    dst = torch.empty_like(src)
    row("copy", n, "torch copy_ (4 B read + 4 B written)", timed(lambda: dst.copy_(src), reps), 8)


def adam_rows(n, reps):
    p = torch.randn(n, device="cuda")
    g = torch.randn(n, device="cuda") * 1e-3
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = [0]

    def ours():
        step[0] += 1
        K.adam_step(p, g, m, v, LR, *BETAS, EPS, WD, True, True, step[0])
    row("fp32 step", n, "zeroshard CUDA fused", timed(ours, reps), 28)
    param = torch.nn.Parameter(p)
    param.grad = g
    for kind in ("fused", "foreach"):
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
        row("fp32 step", n, f"torch AdamW {kind}", timed(opt.step, reps), 28)
    g16 = (torch.randn(n, device="cuda") * SCALE * 1e-4).to(torch.bfloat16)
    p16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")

    def ours16():
        step[0] += 1
        K.adam_step(p, g16, m, v, LR, *BETAS, EPS, WD, True, True, step[0], param16=p16,
                    grad_scale=1.0 / SCALE)
    row("bf16 step", n, "zeroshard CUDA fused (unscale + step + bf16 copy)", timed(ours16, reps), 28)
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def torch16():
        param.grad = g16.float().mul_(1.0 / SCALE)
        opt.step()
        p16.copy_(param.detach())
    row("bf16 step", n, "torch: cast + unscale, AdamW fused, cast back", timed(torch16, reps), 28)


if __name__ == "__main__":
    main()
