"""The step-time cost of the per-rank trace and of the comms logger, on bench/zero_step.py's
~100M GPT at ZeRO stage 3, world 2 (CPU, Gloo, one thread per rank), measured inside one pair of
processes so that both sides of each comparison share the machine's state:

    python3 -m zeroshard.launcher.runner --num_gpus 2 bench/observe_overhead.py [--steps-each 36]

Steps rotate through three kinds (each after each other kind equally often), so that the
machine's drift falls on every side alike:
- plain: nothing recorded;
- comms: the comms logger on (it is read on every collective);
- trace: the engine's trace records the step as a traced window's step does (module spans,
  collectives, waits, gathers, copies, memory counters); the window's start (a barrier, a gc
  pass) is made before the timed part and what it recorded is dropped after it, so neither the
  start nor the file writing (timed apart once, at the end) counts in a traced step.

A step's time is the slower rank's (forward, backward, step). Prints one table; timings only."""
import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

KINDS = ("plain", "comms", "trace")
# Each kind follows each other kind equally often: a step can cost more after a certain kind.
ROTATION = ("plain", "comms", "trace", "plain", "trace", "comms")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps-each", dest="each", type=int, default=36, help="timed steps of each kind (even)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.each < 2 or a.each % 2:
        p.error(f"--steps-each: got {a.each}, expected an even number >= 2 (the rotation's two orders)")
    torch.set_num_threads(1)
    import zeroshard
    from zeroshard import _C
    from gpt import GPT, ByteWindows, stdlib_text_bytes

    out_dir = tempfile.mkdtemp(prefix="zs-overhead-trace-")
    # The engine gets a Trace (steps []: no window of its own); the loop below opens one per traced step.
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 100000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3}, "comms_logger": {"enabled": False},
              "trace": {"enabled": True, "output_path": out_dir, "steps": []}}
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=128, d_model=768, n_layers=14, n_heads=12)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = engine.global_rank, engine.world_size
    tracer = engine._observer.trace  # the engine's own Trace: the recording path a window runs
    data = ByteWindows(stdlib_text_bytes(), 128)
    times = {kind: [] for kind in KINDS}
    gc_ms = {kind: [] for kind in KINDS}  # Python's garbage collector's pauses inside each step
    pause = {"start": 0.0, "total": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            pause["start"] = time.perf_counter()
        else:
            pause["total"] += time.perf_counter() - pause["start"]
    gc.callbacks.append(on_gc)
    events = 0
    plan = ["plain"] * a.warmup + [ROTATION[i % len(ROTATION)] for i in range(len(KINDS) * a.each)] + ["write"]
    for step, kind in enumerate(plan, start=1):
        _C.comms.configure(kind == "comms", False, True, False, [], rank)
        # Trace's step_begins would start a window on any step (steps []): this loop starts them.
        tracer._done = True
        batch = torch.stack([data[(step * world + rank) % len(data)]])
        if kind in ("trace", "write"):
            # A window's start (its barrier, a gc pass, the hooks attached) happens once per
            # window: outside the timed part, as the file writing at its end.
            tracer._start()
        dist.barrier()
        pause["total"] = 0.0
        t = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        seconds = torch.tensor([time.perf_counter() - t])
        collected = pause["total"]
        # The trace's internals drive this: check they did what each kind means.
        assert _C.trace.on() == (kind in ("trace", "write")), (step, kind)
        if kind == "trace":  # dropped, as if the window went on
            tracer._spans.remove()
            tracer._spans = None
            _C.trace.stop()
            events = len(_C.trace.drain())
            assert events > 0, f"step {step}: the traced step recorded nothing"
        elif kind == "write":
            t = time.perf_counter()
            tracer._finish(merge=True)
            seconds = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if kind in times and step > a.warmup:
            times[kind].append(float(seconds) * 1e3)
            gc_ms[kind].append(collected * 1e3)
        elif kind == "write":
            write_ms = float(seconds) * 1e3
    if rank != 0:
        return
    plain = statistics.median(times["plain"])
    print("| steps | ms/step (median) | against plain | 90% interval (bootstrap) | min-max | rank 0's gc pauses (ms/step, mean) |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        med = statistics.median(times[kind])
        lo, hi = _interval(times[kind], times["plain"])
        print(f"| {kind} | {med:.0f} | {100 * (med / plain - 1):+.1f}% | {lo:+.1f}% to {hi:+.1f}% "
              f"| {min(times[kind]):.0f}-{max(times[kind]):.0f} | {statistics.mean(gc_ms[kind]):.0f} |")
    print(f"\nsteps of each kind: {a.each}; events a traced step recorded on rank 0: {events}; "
          f"writing one traced step's files (per rank, the merge on rank 0): {write_ms:.0f} ms; "
          f"files in {out_dir}")


def _interval(kind_ms, plain_ms, rounds=2000):
    """A 90% bootstrap interval of median(kind) / median(plain) - 1, in percent: how far the
    machine's step-to-step spread leaves the estimate."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(kind_ms, k=len(kind_ms))) /
                    statistics.median(rng.choices(plain_ms, k=len(plain_ms))) - 1 for _ in range(rounds))
    return 100 * ratios[int(0.05 * rounds)], 100 * ratios[int(0.95 * rounds)]


if __name__ == "__main__":
    main()
