"""The step-time cost of the per-rank trace and of the comms logger, on bench/zero_step.py's
~100M GPT at ZeRO stage 3 (CPU, Gloo, one thread per rank), measured inside one set of processes
so that both sides of each comparison share the machine's state:

    python3 -m zeroshard.launcher.runner --num_gpus 2 bench/observe_overhead.py [--blocks-each 6]

Steps run in blocks of consecutive steps of one kind, as a traced window runs (a step's cost
also shows in the step after it: a step after a traced one was seen to run ~15% slower, which
alternating single steps charges to the other kinds). Blocks rotate through the kinds, each
after each other kind equally often, so that the machine's drift falls on every kind alike:
- plain: nothing recorded;
- comms: the comms logger on (it is read on every collective);
- trace: one traced window over the block (module spans, collectives, waits, gathers, copies,
  memory counters); its start (a barrier, a young-generation gc pass, the hooks attached) is
  made before the block's timed steps and what it recorded is dropped after them, so neither the
  start nor the file writing (timed apart once, at the end) counts in a traced step; both are
  printed apart, with each kind's first step of a block (left out of the table).
With --split, the comms blocks give way to the trace's two halves: "runtime" (everything a
window records but the module spans, which are detached; the heap stays frozen as in a window)
and "spans" (the module spans' hooks, the runtime's recording stopped, so nothing is stored;
the Python phase sampling runs in both). Neither includes storing the module spans' events.
The first step of every block is left out (it carries the step before it). A step's time is the
slower rank's (forward, backward, step). Prints one table; timings only."""
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
# Each kind of block follows each other kind equally often: a step can cost more after a certain kind.
ROTATION = ("plain", "comms", "trace", "plain", "trace", "comms")
# --split: the trace's two halves apart, "runtime" (all but the module spans) and "spans" (the
# module spans' hooks, nothing stored); see the docstring. Each of the 12 ordered pairs once.
SPLIT_KINDS = ("plain", "trace", "runtime", "spans")
SPLIT_ROTATION = ("plain", "trace", "runtime", "spans", "plain", "runtime", "trace", "spans", "runtime",
                  "plain", "spans", "trace")
TRACED = ("trace", "runtime", "spans")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks-each", dest="blocks", type=int, default=6,
                   help="blocks of each kind (even; a multiple of 3 with --split)")
    p.add_argument("--block", type=int, default=7, help="steps per block (the first is left out)")
    p.add_argument("--split", action="store_true",
                   help="time the trace's halves apart (runtime events, module spans), not the comms logger")
    p.add_argument("--warmup", type=int, default=1, help="plain blocks first, not counted (>= 1)")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    kinds, rotation = (SPLIT_KINDS, SPLIT_ROTATION) if a.split else (KINDS, ROTATION)
    per = len(rotation) // len(kinds)  # blocks of each kind in one rotation
    if a.blocks < per or a.blocks % per:
        p.error(f"--blocks-each: got {a.blocks}, expected a multiple of {per} (whole rotations)")
    if a.warmup < 1:
        p.error(f"--warmup: got {a.warmup}, expected >= 1 (plain blocks before the rotation)")
    if a.block < 2:
        p.error(f"--block: got {a.block}, expected >= 2 (a block's first step is left out)")
    torch.set_num_threads(1)
    import zeroshard
    from zeroshard import _C
    from gpt import GPT, ByteWindows, stdlib_text_bytes

    out_dir = tempfile.mkdtemp(prefix="zs-overhead-trace-")
    # The engine gets a Trace (steps []: no window of its own); the loop below opens one per traced block.
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 100000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3}, "comms_logger": {"enabled": False},
              "trace": {"enabled": True, "output_path": out_dir, "steps": []}}
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=128, d_model=768, n_layers=14, n_heads=12)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = engine.global_rank, engine.world_size
    tracer = engine._observer.trace  # the engine's own Trace: the recording path a window runs
    tracer._bounded = True  # each window here is a few steps, as a window of listed steps starts
    data = ByteWindows(stdlib_text_bytes(), 128)
    times = {kind: [] for kind in kinds}
    gc_ms = {kind: [] for kind in kinds}  # Python's garbage collector's pauses inside each step
    pause = {"start": 0.0, "total": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            pause["start"] = time.perf_counter()
        else:
            pause["total"] += time.perf_counter() - pause["start"]
    gc.callbacks.append(on_gc)
    events = 0
    start_ms = []  # each traced window's start (slowest rank)
    first_ms = {kind: [] for kind in kinds}  # each block's first step, left out of the table

    def run_step(step):
        batch = torch.stack([data[(step * world + rank) % len(data)]])
        dist.barrier()
        pause["total"] = 0.0
        t = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        seconds = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds) * 1e3, pause["total"] * 1e3

    # Timed blocks start at the rotation's second kind: the plain warm-up before them stands in for
    # the rotation's wrap (its last kind -> plain), so each kind follows each other equally often.
    blocks = ["plain"] * a.warmup + [rotation[(i + 1) % len(rotation)] for i in range(len(kinds) * a.blocks)]
    step = 0
    for number, kind in enumerate(blocks):
        _C.comms.configure(kind == "comms", False, True, False, [], rank)
        # Trace.step_begins would start a window on any step (steps []): this loop does. While a
        # window records, step_begins still starts each of its steps (new_step), as in a real window.
        tracer._done = True
        if kind in TRACED:
            t = time.perf_counter()
            tracer._start()  # a window's start, once per window: outside the timed steps
            if kind == "trace":
                start_ms.append(_slowest_ms(time.perf_counter() - t))
            if kind == "runtime":  # the module spans' hooks detached; the window's freeze kept
                for handle in tracer._spans._handles:
                    handle.remove()
            elif kind == "spans":
                _C.trace.stop()
        timed = []
        for i in range(a.block):
            step += 1
            ms, collected = run_step(step)
            # The trace's internals drive this: check they did what each kind means.
            assert _C.trace.on() == (kind in ("trace", "runtime")), (step, kind)
            if i > 0 and number >= a.warmup:
                timed.append(ms)
                gc_ms[kind].append(collected)
            elif number >= a.warmup:
                first_ms[kind].append(ms)
        if timed:
            times[kind].append(timed)
        if kind in TRACED:  # dropped, as if the window went on
            tracer._spans.remove()  # detaches what is attached, undoes the freeze
            tracer._spans = None
            _C.trace.stop()
            drained = _C.trace.drain()
            if kind == "trace":
                events = len(drained) // a.block
            # spans: only the memory samples the window's start took before its recording stopped
            stored = [e for e in drained if e[1] != "memory"]
            assert bool(stored) == (kind != "spans"), f"block {number} ({kind}): {len(stored)} events"
    # Writing: one more traced step, its window's files written and timed.
    _C.comms.configure(False, False, True, False, [], rank)
    tracer._start()
    run_step(step + 1)
    t = time.perf_counter()
    tracer._finish(merge=True)
    write_ms = _slowest_ms(time.perf_counter() - t)
    if rank != 0:
        return
    flat = {kind: [ms for block in times[kind] for ms in block] for kind in kinds}
    plain = statistics.median(flat["plain"])
    print("| steps | ms/step (median) | against plain | 90% interval (bootstrap over blocks) | min-max "
          "| rank 0's gc pauses (ms/step, mean) |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        med = statistics.median(flat[kind])
        lo, hi = _interval(times[kind], times["plain"])
        print(f"| {kind} | {med:.0f} | {100 * (med / plain - 1):+.1f}% | {lo:+.1f}% to {hi:+.1f}% "
              f"| {min(flat[kind]):.0f}-{max(flat[kind]):.0f} | {statistics.mean(gc_ms[kind]):.0f} |")
    print(f"\nworld {world}; blocks of each kind: {a.blocks} of {a.block} steps, {a.block - 1} timed; "
          f"events a traced step recorded on rank 0: {events}; "
          f"writing one traced step's files (per rank, the merge on rank 0): {write_ms:.0f} ms; "
          f"files in {out_dir}")
    print(f"a traced window's start (barrier, young-generation gc pass, hooks attached; slowest rank), mean of "
          f"{len(start_ms)}: {statistics.mean(start_ms):.0f} ms (min-max {min(start_ms):.0f}-{max(start_ms):.0f}); "
          "each block's first step (left out above), median: " +
          ", ".join(f"{kind} {statistics.median(first_ms[kind]):.0f} ms" for kind in kinds))


def _slowest_ms(seconds):
    """The slowest rank's time, in ms (every rank calls this at the same point)."""
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) * 1e3


def _interval(kind_blocks, plain_blocks, rounds=2000):
    """A 90% bootstrap interval of median(kind) / median(plain) - 1, in percent, resampling whole
    blocks (steps in one block share the machine's state of the moment): how far the machine's
    spread leaves the estimate."""
    rng = random.Random(0)

    def median_of(blocks):
        return statistics.median(ms for block in rng.choices(blocks, k=len(blocks)) for ms in block)
    ratios = sorted(median_of(kind_blocks) / median_of(plain_blocks) - 1 for _ in range(rounds))
    return 100 * ratios[int(0.05 * rounds)], 100 * ratios[int(0.95 * rounds)]


if __name__ == "__main__":
    main()
