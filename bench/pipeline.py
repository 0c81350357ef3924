"""Pipeline schedules side by side: zeroshard's gpipe, 1f1b, interleaved_1f1b and zero_bubble against
torch.distributed.pipelining's matching schedules and DeepSpeed's PipelineEngine (1F1B), on the
same GPT layers split into 2 stages, one process and one thread per stage (this machine has 2
cores), Gloo on loopback, fp32.

For zeroshard it also measures the bubble: every instruction of the last timed step is
timestamped on the monotonic clock all processes share, and the bubble is 1 - (compute time
summed over ranks) / (ranks x the step's makespan), against the schedule's theory
((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, ZB-H1's (p-1)(F+B-W)/... from
the checker at the measured F, B, W). Deeper pipelines cannot be timed on 2 cores: for 4 and 8
stages it prints the executed lists' simulated bubble at the per-instruction costs measured here.

    python bench/pipeline.py [--micro-batches 8] [--steps 5] [--no-peers]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

VOCAB, SEQ, D, HEADS, LAYERS, MICRO = 256, 128, 256, 4, 8, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Embedding(SEQ, D)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.out = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def block():
    from gpt import Block
    return Block(D, HEADS)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def data(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (m * MICRO, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def config(m, schedule="1f1b", virtual=1):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "steps_per_print": 10 ** 6,
            "pipeline": {"schedule": schedule, "virtual_stages": virtual}}


# ----- zeroshard -----
def zeroshard_rank(m, steps):
    import zeroshard
    from zeroshard import _C
    from zeroshard.pipe import LayerSpec, PipelineModule
    out = {}
    x, y = data(m)
    micro = [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(m)]
    for schedule, v in SCHEDULES:
        layers = [LayerSpec(Embed)] + [LayerSpec(type(block()), D, HEADS) for _ in range(LAYERS)] + [LayerSpec(Head)]
        net = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="type:Block",
                             virtual_stages=v)
        engine, _, _, _ = zeroshard.initialize(model=net, config=config(m, schedule, v),
                                               model_parameters=list(net.parameters()))
        times = []
        for step in range(steps + 1):
            engine._timeline = [] if step == steps else None
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(micro))
            times.append(time.perf_counter() - t0)
        out[schedule] = {"step_s": sorted(times[1:])[len(times[1:]) // 2],
                         "timeline": engine._timeline, "virtual": v}
        if schedule in ("1f1b", "zero_bubble", "interleaved_1f1b"):
            out[schedule]["lists"] = _C.pipeline.build(schedule, 2, m, v)[0]
    return out


def bubble(timelines):
    """Measured: 1 - compute summed over ranks / (ranks x makespan), the makespan from the first
    instruction's start to the last compute's end over all ranks."""
    start = min(t[3] for tl in timelines for t in tl)
    end = max(t[4] for tl in timelines for t in tl if t[0] in COMPUTE)
    busy = sum(t[4] - t[3] for tl in timelines for t in tl if t[0] in COMPUTE)
    return 1 - busy / (len(timelines) * (end - start))


def costs(timelines):
    """Mean seconds of each compute instruction kind, per model chunk's worth of layers."""
    sums = {}
    for tl in timelines:
        for op, _, _, a, b in tl:
            if op in COMPUTE:
                sums.setdefault(op, []).append(b - a)
    return {op: sum(v) / len(v) for op, v in sums.items()}


# ----- torch.distributed.pipelining -----
def torch_rank(m, steps, only):
    import torch.distributed as dist
    from torch.distributed import pipelining as pp
    rank = dist.get_rank()
    x, y = data(m)
    out = {}
    for schedule, v in SCHEDULES:
        if schedule != only:
            continue
        torch.manual_seed(0)
        layers = [Embed()] + [block() for _ in range(LAYERS)] + [Head()]
        n = 2 * v
        per = [1 + LAYERS // n if i == 0 else LAYERS // n for i in range(n)]
        per[-1] += 1
        bounds = [0]
        for c in per:
            bounds.append(bounds[-1] + c)
        stages = [pp.PipelineStage(torch.nn.Sequential(*layers[bounds[s]:bounds[s + 1]]), s, n, torch.device("cpu"))
                  for s in range(rank, n, 2)]
        params = [p for st in stages for p in st.submod.parameters()]
        opt = torch.optim.Adam(params, lr=1e-4)
        cls = getattr(pp, TORCH_NAMES[schedule])
        try:
            sched = cls(stages if len(stages) > 1 or schedule == "zero_bubble" else stages[0], n_microbatches=m,
                        loss_fn=loss_fn)
            times = []
            for _ in range(steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                if rank == 0:
                    sched.step(x)
                else:
                    sched.step(target=y, losses=[])
                opt.step()
                times.append(time.perf_counter() - t0)
            out[schedule] = {"step_s": sorted(times[1:])[len(times[1:]) // 2]}
        except Exception as error:  # noqa: BLE001 - reported in the table
            out[schedule] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    return out


# ----- DeepSpeed (its own venv: /tmp/ds-venv), run as a script by run_deepspeed -----
def deepspeed_rank(m, steps):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [LayerSpec(Embed)] + [LayerSpec(type(block()), D, HEADS) for _ in range(LAYERS)] + [LayerSpec(Head)]
    net = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="type:Block")
    cfg = config(m)
    del cfg["pipeline"]
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=list(net.parameters()))
    x, y = data(m)
    micro = [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(m)]
    times = []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(micro))
        times.append(time.perf_counter() - t0)
    return {"1f1b": {"step_s": sorted(times[1:])[len(times[1:]) // 2], "version": deepspeed.__version__}}


def _entry(fn, rank, port, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    if not dist.is_initialized() and fn is not deepspeed_rank:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    result = fn(*args)
    queue.put((rank, result))


def spawn(fn, *args, timeout=900):
    """fn(*args) on 2 ranks; None where they do not finish within `timeout` seconds."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(fn, r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    except Exception:  # noqa: BLE001 - queue.Empty: a rank hangs
        for p in procs:
            p.kill()
        return None
    for p in procs:
        p.join()
    return [results[0], results[1]]


def run_deepspeed(m, steps):
    python = "/tmp/ds-venv/bin/python"
    if not os.path.exists(python):
        return None
    code = ("import sys, json; sys.path.insert(0, %r); import pipeline as b; "
            "print('RESULT', json.dumps(b.spawn(b.deepspeed_rank, %d, %d, timeout=300)))" % (os.path.dirname(__file__), m, steps))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.path.dirname(__file__))
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=420)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def theory(schedule, p, m, v, measured_costs):
    from zeroshard import _C
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    lists = _C.pipeline.build(schedule, p, m, v)[0]
    return _C.pipeline.simulate(lists, m, v, measured_costs)["bubble_fraction"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args()
    m, steps = args.micro_batches, args.steps
    samples = m * MICRO
    ours = spawn(zeroshard_rank, m, steps)
    peers = {}
    if not args.no_peers:
        merged = {}
        for schedule, _ in SCHEDULES:
            got = spawn(torch_rank, m, steps, schedule, timeout=180)
            merged[schedule] = got[0][schedule] if got else {"error": "did not finish within 180 s (a hang)"}
        peers["torch"] = [merged]
    if not args.no_peers:
        peers["deepspeed"] = run_deepspeed(m, steps) or {"error": "did not finish within 300 s (a hang)"}
    from zeroshard import _C
    print(f"GPT: {LAYERS} blocks, d_model {D}, seq {SEQ}, micro-batch {MICRO}, {m} micro-batches per step, "
          "2 stages (one process, one thread each), fp32, Gloo")
    print(f"{'schedule':18} {'zeroshard samples/s':>20} {'torch':>10} {'deepspeed':>10} "
          f"{'bubble measured':>16} {'theory':>8}")
    for schedule, v in SCHEDULES:
        z = ours[0][schedule]
        step = max(ours[0][schedule]["step_s"], ours[1][schedule]["step_s"])
        tls = [ours[0][schedule]["timeline"], ours[1][schedule]["timeline"]]
        measured = costs(tls)
        model = {"forward": measured["forward"]}
        if "backward" in measured:
            model["backward"] = measured["backward"]
        if "backward_input" in measured:
            model.update(backward_input=measured["backward_input"], backward_weight=measured["backward_weight"])
        th = theory(schedule, 2, m, z["virtual"], model)
        cells = []
        for peer in ("torch", "deepspeed"):
            r = (peers.get(peer) or [{}])[0] if peer == "torch" else (peers.get("deepspeed") or {})
            r = r[0] if isinstance(r, list) else r
            got = r.get(schedule) if isinstance(r, dict) else None
            if got and "step_s" in got:
                cells.append(f"{samples / got['step_s']:10.1f}")
            else:
                cells.append(f"{'-':>10}")
        print(f"{schedule:18} {samples / step:20.1f} {cells[0]} {cells[1]} {bubble(tls):16.3f} {th:8.3f}")
        sim = []
        for p in (4, 8):
            if schedule == "interleaved_1f1b" and m % p:
                continue
            lists = _C.pipeline.build(schedule, p, m, z["virtual"])[0]
            sim.append(f"p={p}: {_C.pipeline.simulate(lists, m, z['virtual'], model)['bubble_fraction']:.3f} "
                       f"(theory {theory(schedule, p, m, z['virtual'], model):.3f})")
        print(f"{'':18} simulated at measured costs {', '.join(sim)}; costs ms "
              + ", ".join(f"{k} {1e3 * c:.1f}" for k, c in model.items()))
    for peer, r in peers.items():
        rr = r[0] if isinstance(r, list) else r
        errors = {k: v["error"] for k, v in (rr or {}).items() if isinstance(v, dict) and "error" in v}
        if isinstance(rr, dict) and "error" in rr and isinstance(rr["error"], str):
            errors = {"all": rr["error"]}
        for k, e in errors.items():
            print(f"{peer} {k}: did not run: {e}")


if __name__ == "__main__":
    main()
