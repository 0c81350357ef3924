"""Pipeline schedules side by side: zeroshard's gpipe, 1f1b, interleaved_1f1b and zero_bubble against
torch.distributed.pipelining's matching schedules and DeepSpeed's PipelineEngine (1F1B), on one GPT
split into --stages stages (2 by default), one process and one thread per stage, Gloo on loopback, fp32.

Verified before timed: each layer is built from its own seed, so all three start from the same
weights, and each run's first step (the warm-up, never timed) must give a one-process reference's
loss on the same data within LOSS_RTOL, else the run is left out of the table (a note says why).
samples/s uses the slowest rank's median step time. Each framework runs each schedule --rounds
times, alternating (see run_rounds); samples/s is the median over the rounds that ran, with its
range and "k/N" when some did not, and zeroshard's samples/s over each peer's in the same round
(paired, so that the machine's drift over a run cancels). For zeroshard every instruction of every step is timestamped
(the same two clock reads in each step) and the bubble is split: "theory", the schedule's closed
form at unit costs and free transfers; "list", the executed lists simulated by the checker at
rank-averaged measured costs with free transfers; "+imbalance", the same lists replayed at each
(rank, chunk)'s own costs; "+runtime", the measured bubble (median over a run's steps) beyond that
(transfers, Python); "-theory", measured minus theory. theory, list and measured are medians over
rounds, +imbalance and +runtime differences of those medians. Deeper pipelines cannot be timed on
2 cores: for deeper ones (4 and 8 stages) it prints the lists' simulated bubble; where there are a
core per stage and more, --stages 4 times them.

    python bench/pipeline.py [--stages 2] [--micro-batches 8] [--steps 5] [--rounds 3] [--schedules gpipe,1f1b,...]
                             [--no-peers] [--deepspeed-venv /tmp/ds-venv]
"""
import argparse
import json
import os
import queue as queue_module
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import Block as GPTBlock  # noqa: E402 - examples/ goes on the path first

VOCAB, SEQ, D, HEADS, LAYERS, MICRO = 256, 128, 256, 4, 8, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
SENDS, RECEIVES = ("send_activation", "send_gradient"), ("receive_activation", "receive_gradient")
LOSS_RTOL = 1e-5      # fp32, same weights and data: only summation order differs
RUN_TIMEOUT_S = 600   # one framework, one schedule, all steps
PEER_GRACE_S = 20     # after one rank raised, how long its peer gets to report before it is killed


# ----- the model: every layer seeded by its index, so any framework builds the same weights -----
class Embed(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Embedding(SEQ, D)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(GPTBlock):  # the name partition_method "type:Block" selects
    def __init__(self, seed):
        torch.manual_seed(seed)
        super().__init__(D, HEADS)


class Head(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.ln = torch.nn.LayerNorm(D)
        self.out = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


LAYER_SPECS = [(Embed, 0)] + [(Block, 1 + i) for i in range(LAYERS)] + [(Head, LAYERS + 1)]


def build_layers():
    return [cls(seed) for cls, seed in LAYER_SPECS]


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def data(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (m * MICRO, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def micro_batches(m):
    x, y = data(m)
    return [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(m)]


def reference_loss(m):
    """The first step's loss without a pipeline: the mean over micro-batches, in one process."""
    model = torch.nn.Sequential(*build_layers())
    with torch.no_grad():
        return sum(float(loss_fn(model(x), y)) for x, y in micro_batches(m)) / m


def config(m, schedule="1f1b", virtual=1):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "steps_per_print": 10 ** 6,
            "pipeline": {"schedule": schedule, "virtual_stages": virtual}}


# ----- the three frameworks, one rank each (run by spawn) -----
def zeroshard_rank(p, m, steps, schedule, v):
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule
    net = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYER_SPECS], num_stages=p, loss_fn=loss_fn,
                         partition_method="type:Block", virtual_stages=v)
    engine, _, _, _ = zeroshard.initialize(model=net, config=config(m, schedule, v),
                                           model_parameters=list(net.parameters()))
    micro = micro_batches(m)
    times, losses, timelines = [], [], []
    for _ in range(steps + 1):
        engine._timeline = []  # recorded in every step, so each pays the same two clock reads per instruction
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(iter(micro))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        timelines.append(engine._timeline)
    engine._timeline = None
    return {"step_s": statistics.median(times[1:]), "first_loss": losses[0], "timelines": timelines[1:]}


def torch_rank(p, m, steps, schedule, v):
    import torch.distributed as dist
    from torch.distributed import pipelining as pp
    rank = dist.get_rank()
    x, y = data(m)
    layers = build_layers()  # all of them (small), so the seeds match; each rank keeps its stages'
    n = p * v
    per = [1 + LAYERS // n if i == 0 else LAYERS // n for i in range(n)]
    per[-1] += 1
    bounds = [0]
    for c in per:
        bounds.append(bounds[-1] + c)
    stages = [pp.PipelineStage(torch.nn.Sequential(*layers[bounds[s]:bounds[s + 1]]), s, n, torch.device("cpu"))
              for s in range(rank, n, p)]
    opt = torch.optim.Adam([p for st in stages for p in st.submod.parameters()], lr=1e-4)
    cls = getattr(pp, TORCH_NAMES[schedule])
    sched = cls(stages if len(stages) > 1 or schedule == "zero_bubble" else stages[0], n_microbatches=m,
                loss_fn=loss_fn)
    times, first_loss = [], None
    for step in range(steps + 1):
        losses = []
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:        # holds stage 0 (and stage p when interleaved)
            sched.step(x)
        elif rank == p - 1:  # holds the last stage
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step == 0 and losses:
            first_loss = float(torch.stack([loss.detach() for loss in losses]).mean())
    return {"step_s": statistics.median(times[1:]), "first_loss": first_loss}


def deepspeed_rank(p, m, steps):
    """In DeepSpeed's own venv (run_deepspeed)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYER_SPECS], num_stages=p, loss_fn=loss_fn,
                         partition_method="type:Block")
    cfg = config(m)
    del cfg["pipeline"]
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=list(net.parameters()))
    micro = micro_batches(m)
    times, losses = [], []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(iter(micro))))
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "first_loss": losses[0], "version": deepspeed.__version__}


# ----- processes -----
class Stopped(Exception):
    """SIGTERM (e.g. from `timeout`) reached the bench: it stops and reports the runs that finished."""


def _stop(signum, frame):
    raise Stopped()


def _reason(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def _entry(fn, rank, world, port, args, queue):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        import torch.distributed as dist
        if fn is not deepspeed_rank:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = (True, fn(*args))
    except BaseException as error:  # noqa: BLE001 - spawn reports it, naming the rank
        result = (False, _reason(error))
    queue.put((rank, *result))


def spawn(fn, world, *args, timeout=RUN_TIMEOUT_S):
    """fn(world, *args) on `world` ranks, one process each. Returns {"ranks": [rank 0's result, ...]} or
    {"error": why}: a rank raised (its exception), died without a result (its exit code), or did not
    finish within `timeout` seconds (a hang)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, (world, *args), queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, queue, timeout)
    finally:  # also when the bench itself is stopped (Stopped): no rank outlives it
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def _collect(procs, queue, timeout):
    results, errors = {}, {}
    deadline = time.monotonic() + timeout

    def receive(wait_s):
        rank, ok, value = queue.get(timeout=wait_s)
        (results if ok else errors)[rank] = value
        return ok

    while len(results) + len(errors) < len(procs):
        try:
            if not receive(1.0):
                # Its peer is likely blocked on it until Gloo's own (30 min) timeout.
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
            continue
        except queue_module.Empty:
            pass
        for r, p in enumerate(procs):
            if r in results or r in errors or p.is_alive():
                continue
            try:  # a result put just before exiting may still be in the pipe
                while True:
                    receive(0.5)
            except queue_module.Empty:
                pass
            if r not in results and r not in errors:
                errors[r] = f"exited with code {p.exitcode} before reporting a result"
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        if time.monotonic() > deadline:
            for r in range(len(procs)):
                if r not in results and r not in errors:
                    errors[r] = (f"killed {PEER_GRACE_S} s after its peer failed" if errors
                                 else f"did not finish within {timeout} s (a hang)")
            break
    if errors:
        return {"error": "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))}
    return {"ranks": [results[r] for r in range(len(procs))]}


def run_deepspeed(p, m, steps, venv):
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return {"error": f"not installed (no {python}; --deepspeed-venv names DeepSpeed's venv)"}
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json\ntry:\n    import deepspeed\nexcept ImportError as e:\n"
            "    print('RESULT', json.dumps({'error': 'not installed in ' + %r + ': ' + str(e)}))\n    raise SystemExit\n"
            "import pipeline as b\nprint('RESULT', json.dumps(b.spawn(b.deepspeed_rank, %d, %d, %d)))" % (venv, p, m, steps))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=here)
    limit_s = RUN_TIMEOUT_S + 120
    # A session of its own, so a timeout kills the ranks it spawned too.
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"did not finish within {limit_s} s (killed)"}
    except Stopped:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exited with code {proc.returncode}: " + (err.strip().splitlines() or ["no output"])[-1][:200]}


# ----- bubbles -----
def theory(schedule, p, m, v, F=1.0, B=1.0, W=1.0):
    """Closed-form bubble fraction, uniform stages and free transfers. GPipe, 1F1B: (p-1)/(m+p-1);
    interleaved with v chunks per rank: (p-1)/(vm+p-1). ZB-H1 (Qi et al. 2023, Zero Bubble Pipeline
    Parallelism, section 3.1): each rank idles (p-1)(F+B-W) of a makespan m(F+B+W) + (p-1)(F+B-W),
    F, B, W the forward, input-gradient and weight-gradient passes; at F=B=W about a third of 1F1B's."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    idle = (p - 1) * max(F + B - W, 0.0)
    return idle / (m * (F + B + W) + idle)


def measured_bubble(step):
    """One step (a timeline per rank): 1 - compute summed over ranks / (ranks x makespan), the
    makespan from the first instruction's start to the last compute's end over all ranks."""
    start = min(t[3] for tl in step for t in tl)
    end = max(t[4] for tl in step for t in tl if t[0] in COMPUTE)
    busy = sum(t[4] - t[3] for tl in step for t in tl if t[0] in COMPUTE)
    return 1 - busy / (len(step) * (end - start))


def rank_costs(steps):
    """One rank's mean seconds per (compute op, chunk) over all its timed steps."""
    sums = {}
    for tl in steps:
        for op, _, chunk, a, b in tl:
            if op in COMPUTE:
                sums.setdefault((op, chunk), []).append(b - a)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def mean_costs(ranks):
    """Mean seconds per compute op over every rank, chunk and step: what _C.pipeline.simulate takes."""
    sums = {}
    for steps in ranks:
        for tl in steps:
            for op, _, _, a, b in tl:
                if op in COMPUTE:
                    sums.setdefault(op, []).append(b - a)
    return {op: sum(v) / len(v) for op, v in sums.items()}


def replay(lists, cost):
    """The checker's timing rules (pipeline/schedule_check.cpp) with a cost per rank, which
    _C.pipeline.simulate cannot take (one cost per op for all ranks): a compute pass adds
    cost(rank, op, chunk) to its rank's clock; a send and its receive complete together once both
    ranks are there (rendezvous, free here); reduce_tied waits for every rank."""
    p = len(lists)
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p

    def step(r):
        if pc[r] >= len(lists[r]):
            return False
        op, _, chunk, peer = lists[r][pc[r]]
        if op == "reduce_tied":
            if any(pc[q] + 3 != len(lists[q]) for q in range(p)):
                return False
            now = max(clock)
            for q in range(p):
                clock[q], pc[q] = now, pc[q] + 1
            return True
        if op in SENDS + RECEIVES:
            other = lists[peer][pc[peer]] if pc[peer] < len(lists[peer]) else None
            if other is None or other[0] not in SENDS + RECEIVES or other[3] != r or (other[0] in SENDS) == (op in SENDS):
                return False
            clock[r] = clock[peer] = max(clock[r], clock[peer])
            pc[r], pc[peer] = pc[r] + 1, pc[peer] + 1
            return True
        if op in COMPUTE:
            clock[r] += cost(r, op, chunk)
            busy[r] += cost(r, op, chunk)
        pc[r] += 1
        return True

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while step(r):
                progress = True
    assert all(pc[r] == len(lists[r]) for r in range(p)), "replay stuck on lists the checker passed"
    return 1 - sum(busy) / (p * max(clock))


def bubbles(schedule, p, m, v, ranks):
    """theory, list (simulated, rank-averaged costs), imbalance (replayed, per-rank costs), measured
    (median over steps), the costs, and the lists' bubble simulated at 4 and 8 stages."""
    from zeroshard import _C
    lists = _C.pipeline.build(schedule, p, m, v)[0]
    timelines = [r["timelines"] for r in ranks]
    for rank, (lst, steps) in enumerate(zip(lists, timelines)):
        planned = [i[:3] for i in lst if i[0] != "optimizer_step"]
        if any([t[:3] for t in tl] != planned for tl in steps):
            raise RuntimeError(f"{schedule}: rank {rank} did not execute the list _C.pipeline.build gives")
    avg = mean_costs(timelines)
    per_rank = [rank_costs(steps) for steps in timelines]
    listed = _C.pipeline.simulate(lists, m, v, avg)["bubble_fraction"]
    check = replay(lists, lambda r, op, chunk: avg[op])
    assert abs(check - listed) < 1e-9, f"replay {check} != the checker's {listed} at the same costs"
    fbw = {"F": avg.get("forward", 1.0), "B": avg.get("backward_input", 1.0), "W": avg.get("backward_weight", 1.0)}
    deeper = {}
    for deep_p in (4, 8):
        if deep_p <= p or (schedule == "interleaved_1f1b" and m % deep_p):
            continue
        deep = _C.pipeline.build(schedule, deep_p, m, v)[0]
        deeper[deep_p] = (_C.pipeline.simulate(deep, m, v, avg)["bubble_fraction"],
                          theory(schedule, deep_p, m, v, **fbw))
    return {"theory": theory(schedule, p, m, v, **fbw), "unit_theory": theory(schedule, p, m, v), "list": listed,
            "imbalance": replay(lists, lambda r, op, chunk: per_rank[r][(op, chunk)]),
            "measured": statistics.median(measured_bubble(step) for step in zip(*timelines)),
            "costs": per_rank, "deeper": deeper}


# ----- report -----
def reported_loss(run):
    """The run's first-step loss (the last stage's rank reports it), or None."""
    return next((r["first_loss"] for r in reversed(run["ranks"]) if r["first_loss"] is not None), None)


def outcome(run, samples, reference):
    """(samples/s or None, note) for one run: samples/s from the slowest rank's median step, or
    why there is none."""
    if "error" in run:
        return None, run["error"]
    ranks = run["ranks"]
    loss = reported_loss(run)
    if loss is None or abs(loss - reference) > LOSS_RTOL * abs(reference):
        return None, f"wrong loss: first-step loss {loss}, reference {reference:.7f}"
    return samples / max(r["step_s"] for r in ranks), None


def cell(per_round, samples, reference):
    """(the median samples/s over the rounds that ran, with its range and k/N when some did not;
    the notes of those that did not)."""
    rates, notes = [], []
    for run in per_round:
        rate, note = outcome(run, samples, reference)
        (rates if rate is not None else notes).append(rate if rate is not None else note)
    if not rates:
        return ("not inst." if all(n.startswith("not installed") for n in notes) else "failed"), notes
    text = f"{statistics.median(rates):.1f}"
    if len(rates) > 1:
        text += f" ({min(rates):.1f}-{max(rates):.1f})"
    if len(rates) < len(per_round):
        text += f" {len(rates)}/{len(per_round)}"
    return text, notes


def paired_ratios(ours, theirs, samples, reference):
    """zeroshard's samples/s over the peer's, round by round (the two ran minutes apart at most, so
    the machine's slower drift cancels), for the rounds where both ran with the right loss."""
    pairs = [(outcome(a, samples, reference)[0], outcome(b, samples, reference)[0]) for a, b in zip(ours, theirs)]
    return [a / b for a, b in pairs if a is not None and b is not None]


def run_rounds(p, m, steps, rounds, peers, venv, schedules):
    """Every framework's run of every schedule, `rounds` times, the frameworks alternating within
    each schedule (zeroshard, then the peers asked for: torch, DeepSpeed's 1F1B), so that the
    machine's drift over the minutes a round takes falls on all alike.
    (framework, schedule) -> [run per round]."""
    runs = {}
    try:
        for number in range(1, rounds + 1):
            for schedule, v in schedules:
                runs.setdefault(("zeroshard", schedule), []).append(spawn(zeroshard_rank, p, m, steps, schedule, v))
                if "torch" in peers:
                    runs.setdefault(("torch", schedule), []).append(spawn(torch_rank, p, m, steps, schedule, v))
                if "deepspeed" in peers and schedule == "1f1b":
                    runs.setdefault(("deepspeed", schedule), []).append(run_deepspeed(p, m, steps, venv))
    except Stopped:
        print(f"STOPPED by SIGTERM in round {number} of {rounds}: the tables hold the runs that had finished")
    return runs


def print_losses(runs, reference):
    for (framework, schedule), per_round in runs.items():
        losses = [reported_loss(run) for run in per_round if "ranks" in run]
        failed = [run["error"] for run in per_round if "error" in run]
        if failed:
            print(f"  {framework:9} {schedule:16} {len(failed)} run(s) did not run: {failed[0][:100]}")
        if losses:
            worst = max(losses, key=lambda x: float("inf") if x is None else abs(x - reference))
            rel = abs(worst - reference) / abs(reference) if worst is not None else float("inf")
            print(f"  {framework:9} {schedule:16} {worst if worst is not None else float('nan'):.7f}  "
                  f"rel {rel:.1e}  {'ok' if rel <= LOSS_RTOL else 'WRONG'}")


def print_schedule(schedule, p, v, runs, peers, samples, reference, m):
    """One schedule's row: samples/s per framework, zeroshard's bubble split, and the details."""
    cells, notes = [], []
    for framework in ["zeroshard"] + [p for p in peers if (p, schedule) in runs]:
        text, failed = cell(runs[framework, schedule], samples, reference)
        cells.append(text)
        notes += [f"{framework}: {note[:160]}" for note in failed]
    cells += ["-"] * (3 - len(cells))  # a framework not asked for, or DeepSpeed beside 1F1B only
    found = []  # (round, bubbles) of zeroshard's rounds whose loss was right
    for number, run in enumerate(runs["zeroshard", schedule], start=1):
        if outcome(run, samples, reference)[0] is None:
            continue
        try:
            found.append((number, bubbles(schedule, p, m, v, run["ranks"])))
        except Exception as error:  # noqa: BLE001 - shown in the table
            notes.append(f"bubble: {_reason(error)}")
    bubble_cells = ""
    if found:
        med = {k: statistics.median(b[k] for _, b in found) for k in ("unit_theory", "list", "imbalance", "measured")}
        bubble_cells = (f"{med['unit_theory']:7.3f} {med['list']:7.3f} {med['imbalance'] - med['list']:+10.3f} "
                        f"{med['measured'] - med['imbalance']:+9.3f} {med['measured']:9.3f} "
                        f"{med['measured'] - med['unit_theory']:+8.3f}")
    print(f"{schedule:18} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} | {bubble_cells}")
    if found:
        number, b = found[len(found) // 2]
        costs = "; ".join(f"rank {r}: " + ", ".join(
            f"{op}{'' if v == 1 else f'[{chunk}]'} {1e3 * s:.1f}" for (op, chunk), s in sorted(c.items()))
            for r, c in enumerate(b["costs"]))
        print(f"{'':20}costs ms (round {number}) {costs}")
        print(f"{'':20}measured bubble per round: " + ", ".join(f"{b_['measured']:.3f}" for _, b_ in found))
        if schedule == "zero_bubble":
            print(f"{'':20}theory: ZB-H1 at F=B=W; its closed form at the rank-averaged measured F, B, W, and "
                  "measured minus it, per round: " + ", ".join(
                      f"{b_['theory']:.3f} ({b_['measured'] - b_['theory']:+.3f})" for _, b_ in found))
        if b["deeper"]:
            print(f"{'':20}simulated at those costs (rank-averaged): " + ", ".join(
                f"{p} stages {sim:.3f} (theory {th:.3f})" for p, (sim, th) in b["deeper"].items()))
    for peer in [p for p in peers if (p, schedule) in runs]:
        ratios = paired_ratios(runs["zeroshard", schedule], runs[peer, schedule], samples, reference)
        if ratios:
            print(f"{'':20}zeroshard / {peer} samples/s in the same round: median {statistics.median(ratios):.3f} "
                  f"(" + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    for note in dict.fromkeys(notes):  # a failure repeated in every round is said once
        print(f"{'':20}{note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages, one process each")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each framework and schedule, alternated")
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES),
                        help="which schedules, comma-separated (default: all)")
    parser.add_argument("--no-peers", action="store_true", help="zeroshard only")
    parser.add_argument("--deepspeed-venv", default="/tmp/ds-venv", help="a venv with DeepSpeed installed")
    args = parser.parse_args()
    p, m, steps = args.stages, args.micro_batches, args.steps
    if p not in (2, 4):
        raise SystemExit(f"--stages: got {p}, expected 2 or 4 (the {LAYERS} blocks in p x 2 interleaved chunks)")
    if steps < 1:
        raise SystemExit(f"--steps: got {steps}, expected >= 1 (timed steps after the warm-up)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: got {args.rounds}, expected >= 1")
    known = dict(SCHEDULES)
    wanted = list(dict.fromkeys(name.strip() for name in args.schedules.split(",") if name.strip()))
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise SystemExit(f"--schedules: got {args.schedules!r}, expected names from {', '.join(known)}")
    schedules = [(name, known[name]) for name in wanted]
    samples = m * MICRO
    torch.set_num_threads(1)
    reference = reference_loss(m)
    peers = [] if args.no_peers else ["torch", "deepspeed"]
    signal.signal(signal.SIGTERM, _stop)
    runs = run_rounds(p, m, steps, args.rounds, peers, args.deepspeed_venv, schedules)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    schedules = [(name, v) for name, v in schedules if ("zeroshard", name) in runs]

    print(f"GPT: {LAYERS} blocks, d_model {D}, seq {SEQ}, micro-batch {MICRO}, {m} micro-batches per step, "
          f"{p} stages (one process, one thread each; {os.cpu_count()} cores), fp32, Gloo; {steps} timed steps after a warm-up; "
          f"{args.rounds} round(s), the frameworks alternating")
    print(f"verified before timing: each run's first-step loss against a one-process reference "
          f"{reference:.7f} (same seeded weights, same data; within relative {LOSS_RTOL:g}); worst run:")
    print_losses(runs, reference)
    print(f"\n{'':18} {'samples/s (median over rounds, range)':^54} | "
          f"{'bubble fraction (medians over rounds; see below)':^56}")
    print(f"{'schedule':18} {'zeroshard':>17} {'torch':>17} {'deepspeed':>17} | {'theory':>7} {'list':>7} "
          f"{'+imbalance':>10} {'+runtime':>9} {'=measured':>9} {'-theory':>8}")
    for schedule, v in schedules:
        print_schedule(schedule, p, v, runs, peers, samples, reference, m)
    print("\ntheory: the closed form at unit costs, free transfers ((p-1)/(m+p-1), divided by v interleaved, "
          "ZB-H1's for zero bubble); list: the executed lists simulated by the checker (_C.pipeline.simulate) "
          "at rank-averaged measured costs, free transfers; +imbalance: replayed at each (rank, chunk)'s own "
          "costs; +runtime: the rest of the measured bubble (transfers, Python; below 0 where buffered sends "
          "beat the checker's rendezvous); -theory: measured minus theory. theory, list, measured: medians "
          "over rounds; +imbalance, +runtime: differences of those medians. Few steps on shared cores: "
          "differences of a few 0.01 are noise")


if __name__ == "__main__":
    main()
