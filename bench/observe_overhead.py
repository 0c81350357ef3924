"""The step-time cost of the per-rank trace and of the comms logger, on bench/zero_step.py's
~100M GPT at ZeRO stage 3, world 2 (CPU, Gloo, one thread per rank), measured inside one pair of
processes so that both sides of each comparison share the machine's state:

    python3 -m zeroshard.launcher.runner --num_gpus 2 bench/observe_overhead.py [--steps-each 8]

- comms logger: switched on and off on alternate steps (it is read on every collective), the
  median of each side compared;
- trace: the config's trace window covers a run of consecutive steps (each traced step records
  everything: module spans, collectives, waits, gathers, copies, memory counters); those steps'
  median is compared with the untraced steps around them. The window's last step, which writes
  the files, is left out of both (it is reported apart).

A step's time is the slower rank's (forward, backward, step). Prints one table; timings only."""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps-each", dest="each", type=int, default=8, help="timed steps on each side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    import zeroshard
    from zeroshard import _C
    from gpt import GPT, ByteWindows, stdlib_text_bytes

    comms_steps = range(a.warmup + 1, a.warmup + 2 * a.each + 1)       # alternating on / off
    trace_first = comms_steps[-1] + 1
    trace_steps = list(range(trace_first, trace_first + a.each + 1))   # + the step that writes
    after = range(trace_steps[-1] + 1, trace_steps[-1] + a.each + 1)   # untraced, after the window
    total = after[-1]
    out_dir = tempfile.mkdtemp(prefix="zs-overhead-trace-")
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 100000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3}, "comms_logger": {"enabled": False},
              "trace": {"enabled": True, "output_path": out_dir, "steps": trace_steps}}
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=128, d_model=768, n_layers=14, n_heads=12)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = engine.global_rank, engine.world_size
    data = ByteWindows(stdlib_text_bytes(), 128)
    times = {}
    for step in range(1, total + 1):
        comms_on = step in comms_steps and (step - comms_steps[0]) % 2 == 0
        _C.comms.configure(comms_on, False, True, False, [], rank)
        batch = torch.stack([data[(step * world + rank) % len(data)]])
        dist.barrier()
        t = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        seconds = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times[step] = float(seconds) * 1e3
    if rank != 0:
        return

    def med(steps):
        return statistics.median(times[s] for s in steps)

    comms_on = [s for s in comms_steps if (s - comms_steps[0]) % 2 == 0]
    comms_off = [s for s in comms_steps if (s - comms_steps[0]) % 2 == 1]
    traced, untraced = trace_steps[:-1], list(after) + comms_off
    rows = [("comms_logger on / off (alternate steps)", med(comms_on), med(comms_off)),
            ("trace on / off (traced window / untraced steps)", med(traced), med(untraced))]
    print("| comparison | ms/step on (median) | ms/step off (median) | overhead |")
    print("|---|---|---|---|")
    for name, on, off in rows:
        print(f"| {name} | {on:.0f} | {off:.0f} | {100 * (on / off - 1):+.1f}% |")
    print(f"\nthe window's last step, which also writes the trace files: {times[trace_steps[-1]]:.0f} ms; "
          f"steps per side: {a.each}; trace in {out_dir}")
    print("all steps (ms): " + " ".join(f"{s}:{times[s]:.0f}" for s in sorted(times)))


if __name__ == "__main__":
    main()
