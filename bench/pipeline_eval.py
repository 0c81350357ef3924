"""eval_batch side by side: zeroshard's PipelineEngine.eval_batch with one model chunk per rank
(1f1b) and with two (interleaved_1f1b), against torch.distributed.pipelining's matching schedules'
eval() (under torch.no_grad(), as an evaluation runs) and DeepSpeed's PipelineEngine.eval_batch
(one chunk), on bench/pipeline.py's GPT, one process and one thread per stage, Gloo on loopback,
fp32. Every run's loss must match one process's forward over the same micro-batches (relative
1e-5), else its row says so instead of a rate. samples/s uses the slowest rank's median call after
a warm-up one; the frameworks alternate within each round, and zeroshard's rate over each peer's
is paired by round (bench/pipeline.py says why).

    python bench/pipeline_eval.py [--stages 2] [--micro-batches 8] [--steps 5] [--rounds 3]
                                  [--deepspeed-venv /tmp/ds-venv] [--malloc-as-is]
"""
import argparse
import statistics
import time

import torch

from pipeline import (LAYERS, LOSS_RTOL, MICRO, TORCH_NAMES, data, deepspeed_engine, loss_fn, micro_batches,
                      reference_loss, torch_stages, zeroshard_engine)
from pipeline_procs import apply_malloc_env, own_process_group, run_deepspeed, spawn

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2)]


def _timed(call, steps):
    times, losses = [], []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        losses.append(call())
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "loss": losses[0]}


def zeroshard_rank(num_stages, m, steps, schedule, v):
    engine = zeroshard_engine(num_stages, m, schedule, v)
    micro = micro_batches(m)
    return _timed(lambda: float(engine.eval_batch(iter(micro))), steps)  # the loss on every rank


def torch_rank(num_stages, m, steps, schedule, v):
    import torch.distributed as dist
    from torch.distributed import pipelining as pp
    rank = dist.get_rank()
    x, y = data(m)
    stages = torch_stages(num_stages, v)
    sched = getattr(pp, TORCH_NAMES[schedule])(stages if len(stages) > 1 else stages[0], n_microbatches=m,
                                               loss_fn=loss_fn)

    def call():
        losses = []
        with torch.no_grad():
            if rank == 0:
                sched.eval(x)
            elif rank == num_stages - 1:
                sched.eval(target=y, losses=losses, return_outputs=False)  # as zeroshard without return_logits
            else:
                sched.eval()
        return float(torch.stack(losses).mean()) if losses else None

    return _timed(call, steps)


@own_process_group
def deepspeed_rank(num_stages, m, steps):
    """In DeepSpeed's own venv (run_deepspeed)."""
    engine = deepspeed_engine(num_stages, m)
    micro = micro_batches(m)
    return _timed(lambda: float(engine.eval_batch(iter(micro))), steps)


def rate(run, samples, reference):
    """(samples/s or None, why not)."""
    if "error" in run:
        return None, run["error"][:160]
    loss = next((r["loss"] for r in reversed(run["ranks"]) if r["loss"] is not None), None)
    if loss is None or not abs(loss - reference) <= LOSS_RTOL * abs(reference):
        return None, f"wrong loss {loss}, reference {reference}"
    return samples / max(r["step_s"] for r in run["ranks"]), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed eval_batch calls, after one warm-up call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deepspeed-venv", default="/tmp/ds-venv")
    parser.add_argument("--malloc-as-is", action="store_true", help="as in bench/pipeline.py")
    args = parser.parse_args()
    if args.stages not in (2, 4) or args.steps < 1 or args.rounds < 1:
        raise SystemExit("--stages 2 or 4, --steps >= 1, --rounds >= 1")
    p, m = args.stages, args.micro_batches
    torch.set_num_threads(1)
    malloc = apply_malloc_env(args.malloc_as_is)
    reference = reference_loss(m)[0]  # the loss before any step: what eval computes
    samples = m * MICRO
    runs = {}
    for _ in range(args.rounds):
        for schedule, v in SCHEDULES:
            runs.setdefault(("zeroshard", schedule), []).append(spawn(zeroshard_rank, p, m, args.steps, schedule, v))
            runs.setdefault(("torch", schedule), []).append(spawn(torch_rank, p, m, args.steps, schedule, v))
            if v == 1:
                runs.setdefault(("deepspeed", schedule), []).append(
                    run_deepspeed(p, m, args.steps, args.deepspeed_venv, "pipeline_eval", "deepspeed_rank"))
    from zeroshard import _C
    print(f"eval_batch: GPT of {LAYERS} blocks, micro-batch {MICRO}, {m} micro-batches, {p} stages (one process, "
          f"one thread each), fp32, Gloo; {args.steps} timed calls after a warm-up; {args.rounds} round(s), "
          f"alternating; losses checked against one process's {reference:.7f} (relative {LOSS_RTOL:g}); "
          f"{malloc}")
    for schedule, v in SCHEDULES:
        unit = _C.pipeline.build_eval(p, m, v)[1]["bubble_fraction"]
        print(f"{schedule} (v={v}; zeroshard's list at unit costs: bubble {unit:.3f})")
        rates = {}
        for framework in ("zeroshard", "torch", "deepspeed"):
            if (framework, schedule) not in runs:
                continue
            got = [rate(run, samples, reference) for run in runs[framework, schedule]]
            rates[framework] = [r for r, _ in got]
            ok = [r for r in rates[framework] if r is not None]
            notes = sorted({n for _, n in got if n})
            text = (f"{statistics.median(ok):.1f} samples/s ({min(ok):.1f}-{max(ok):.1f})" if ok else "no rate")
            print(f"  {framework:9} {text}  per round: " + ", ".join("-" if r is None else f"{r:.1f}"
                                                                      for r in rates[framework])
                  + (f"  [{'; '.join(notes)}]" if notes else ""))
        for peer in ("torch", "deepspeed"):
            pairs = [a / b for a, b in zip(rates["zeroshard"], rates.get(peer, [])) if a and b]
            if pairs:
                print(f"  zeroshard / {peer} in the same round: median {statistics.median(pairs):.3f} ("
                      + ", ".join(f"{x:.3f}" for x in pairs) + ")")


if __name__ == "__main__":
    main()
