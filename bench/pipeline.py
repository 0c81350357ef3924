"""Pipeline schedules side by side: zeroshard's gpipe, 1f1b, interleaved_1f1b and zero_bubble against
torch.distributed.pipelining's matching schedules and DeepSpeed's PipelineEngine (1F1B), on one GPT
split into --stages stages (2 by default), one process and one thread per stage, Gloo on loopback, fp32.

Verified: each layer is built from its own seed, so all three start from the same weights, and
each run's first step (the warm-up, never timed) and second (after one Adam step on the same batch,
at an eps that makes the step follow each gradient's size) must give a one-process torch.optim.Adam
reference's losses within LOSS_RTOL, else the run is left out of the table (a note says why): the
forward matches, and a skipped or wrongly scaled gradient shows (how much, in bench/RESULTS.md,
"Do the peers train the same weights?").
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
2 cores: for 4 and 8 stages (where deeper than --stages) it prints the lists' simulated bubble at
the measured costs; with a core per rank or more, --stages 4 times 4 stages. A SIGTERM (`timeout`)
stops the runs and prints the tables of those that had finished. Beside the bubble, each schedule's
rows give the compute share of a step for zeroshard and torch, and per step for every framework the
main thread's involuntary context switches, minor page faults and CPU time and the whole process's
CPU time (bench/pipeline_probes.py).

    python bench/pipeline.py [--stages 2] [--micro-batches 8] [--steps 5] [--rounds 3] [--schedules gpipe,1f1b,...]
                             [--no-peers] [--deepspeed-venv /tmp/ds-venv] [--pin] [--malloc-as-is] [--dump FILE]
"""
import argparse
import json
import math
import os
import signal
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import Block as GPTBlock  # noqa: E402 - examples/ goes on the path first
from pipeline_bubbles import bubbles  # noqa: E402 - bench/, this script's folder, is sys.path[0]
from pipeline_probes import (USAGE_FIELDS, busy_shares, median_usage, pinned_cpus, run_usage,  # noqa: E402
                             thread_usage, time_torch_compute)
from pipeline_procs import (PIN_ENV, Stopped, apply_malloc_env, own_process_group, reason,  # noqa: E402
                            run_deepspeed, spawn, stop)

VOCAB, SEQ, D, HEADS, LAYERS, MICRO = 256, 128, 256, 4, 8, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}
LOSS_RTOL = 1e-5      # fp32, same weights and data: only summation order differs
# Adam with a large eps: its first step moves each weight by about LR * g / (|g| + EPS), so the
# second step's loss sees a gradient's size, not only its sign (bench/RESULTS.md, "Do the peers
# train the same weights?").
LR, EPS = 0.1, 1.0


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
    """(first, second) step's loss without a pipeline, in one process: the mean over micro-batches
    before and after one torch.optim.Adam step on them (every step trains on the same batch). The
    second shows that every weight was trained as the reference trains it, not only that the
    forward matches."""
    model = torch.nn.Sequential(*build_layers())
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    first = 0.0
    for x, y in micro_batches(m):
        loss = loss_fn(model(x), y)
        (loss / m).backward()
        first += loss.item() / m
    opt.step()
    with torch.no_grad():
        return first, sum(float(loss_fn(model(x), y)) for x, y in micro_batches(m)) / m


def config(m, schedule="1f1b", virtual=1):
    # gradient_clipping spelled out: DeepSpeed 0.19.3+ clips at 1.0 when it is left out; no other
    # framework here clips.
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS}}, "steps_per_print": 10 ** 6,
            "pipeline": {"schedule": schedule, "virtual_stages": virtual}}


# ----- the three frameworks, one rank each (run by spawn) -----
def zeroshard_engine(num_stages, m, schedule, v):
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule
    net = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYER_SPECS], num_stages=num_stages, loss_fn=loss_fn,
                         partition_method="type:Block", virtual_stages=v)
    return zeroshard.initialize(model=net, config=config(m, schedule, v), model_parameters=list(net.parameters()))[0]


def zeroshard_rank(num_stages, m, steps, schedule, v):
    engine = zeroshard_engine(num_stages, m, schedule, v)
    micro = micro_batches(m)
    times, losses, timelines, usage = [], [], [], []
    for _ in range(steps + 1):
        engine._timeline = []  # recorded in every step, so each pays the same two clock reads per instruction
        torch.distributed.barrier()
        u0, t0 = thread_usage(), time.perf_counter()
        loss = engine.train_batch(iter(micro))
        times.append(time.perf_counter() - t0)
        usage.append(thread_usage(u0))
        losses.append(float(loss))
        timelines.append(engine._timeline)
    engine._timeline = None
    return {"step_s": statistics.median(times[1:]), "losses": losses[:2], "timelines": timelines[1:],
            "usage": median_usage(usage[1:])}


def torch_stages(num_stages, v):
    """This rank's torch.distributed.pipelining stages: the blocks split evenly over num_stages x v
    stages, the embedding on the first and the head on the last, stage s on rank s % num_stages."""
    from torch.distributed import pipelining as pp
    layers = build_layers()  # all of them (small), so the seeds match; each rank keeps its stages'
    n = num_stages * v
    per = [1 + LAYERS // n if i == 0 else LAYERS // n for i in range(n)]
    per[-1] += 1
    bounds = [0]
    for c in per:
        bounds.append(bounds[-1] + c)
    return [pp.PipelineStage(torch.nn.Sequential(*layers[bounds[s]:bounds[s + 1]]), s, n, torch.device("cpu"))
            for s in range(torch.distributed.get_rank(), n, num_stages)]


def torch_rank(num_stages, m, steps, schedule, v):
    import torch.distributed as dist
    from torch.distributed import pipelining as pp
    rank = dist.get_rank()
    x, y = data(m)
    stages = torch_stages(num_stages, v)
    opt = torch.optim.Adam([p for st in stages for p in st.submod.parameters()], lr=LR, eps=EPS)
    compute = time_torch_compute([st.submod for st in stages])
    cls = getattr(pp, TORCH_NAMES[schedule])
    sched = cls(stages if len(stages) > 1 or schedule == "zero_bubble" else stages[0], n_microbatches=m,
                loss_fn=loss_fn)
    times, step_losses, computed, usage = [], [], [], []
    for step in range(steps + 1):
        losses = []
        dist.barrier()
        compute[0] = 0.0
        u0, t0 = thread_usage(), time.perf_counter()
        opt.zero_grad()
        if rank == 0:                 # holds stage 0 (and stage num_stages when interleaved)
            sched.step(x)
        elif rank == num_stages - 1:  # holds the last stage
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        times.append(time.perf_counter() - t0)
        usage.append(thread_usage(u0))
        computed.append(compute[0])
        if step < 2 and losses:
            step_losses.append(float(torch.stack([loss.detach() for loss in losses]).mean()))
    return {"step_s": statistics.median(times[1:]), "losses": step_losses or None,
            "compute_s": statistics.median(computed[1:]), "usage": median_usage(usage[1:])}


def deepspeed_engine(num_stages, m):
    """DeepSpeed's PipelineEngine on this model (in DeepSpeed's own venv: run_deepspeed)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYER_SPECS], num_stages=num_stages, loss_fn=loss_fn,
                         partition_method="type:Block")
    cfg = config(m)
    del cfg["pipeline"]
    return deepspeed.initialize(model=net, config=cfg, model_parameters=list(net.parameters()))[0]


@own_process_group
def deepspeed_rank(num_stages, m, steps):
    """In DeepSpeed's own venv (run_deepspeed)."""
    import deepspeed
    engine = deepspeed_engine(num_stages, m)
    micro = micro_batches(m)
    times, losses, usage = [], [], []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        u0, t0 = thread_usage(), time.perf_counter()
        losses.append(float(engine.train_batch(iter(micro))))
        times.append(time.perf_counter() - t0)
        usage.append(thread_usage(u0))
    return {"step_s": statistics.median(times[1:]), "losses": losses[:2], "version": deepspeed.__version__,
            "usage": median_usage(usage[1:])}


# ----- report -----
def reported_loss(run):
    """The run's first- and second-step losses (the last stage's rank reports them), or None."""
    return next((r["losses"] for r in reversed(run["ranks"]) if r["losses"] is not None), None)


def loss_error(losses, reference):
    """The larger relative error of the two steps' losses against the reference's (inf if missing
    or not finite: a NaN would compare as passing)."""
    if losses is None or len(losses) < 2 or not all(math.isfinite(x) for x in losses):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def outcome(run, samples, reference):
    """(samples/s or None, note) for one run: samples/s from the slowest rank's median step, or
    why there is none."""
    if "error" in run:
        return None, run["error"]
    ranks = run["ranks"]
    losses = reported_loss(run)
    if not loss_error(losses, reference) <= LOSS_RTOL:
        return None, f"wrong loss: first- and second-step losses {losses}, reference {reference}"
    return samples / max(r["step_s"] for r in ranks), None


def cell(per_round, samples, reference, rounds):
    """(the median samples/s over the rounds that ran, with its range and k/N when fewer than the
    `rounds` asked for did, failed or were never reached; the notes of those that failed)."""
    rates, notes = [], []
    for run in per_round:
        rate, note = outcome(run, samples, reference)
        (rates if rate is not None else notes).append(rate if rate is not None else note)
    if not rates:
        if not notes:
            return "not run", notes
        return ("not inst." if all(n.startswith("not installed") for n in notes) else "failed"), notes
    text = f"{statistics.median(rates):.1f}"
    if len(rates) > 1:
        text += f" ({min(rates):.1f}-{max(rates):.1f})"
    if len(rates) < rounds:
        text += f" {len(rates)}/{rounds}"
    return text, notes


def paired_ratios(ours, theirs, samples, reference):
    """zeroshard's samples/s over the peer's, round by round (the two ran minutes apart at most, so
    the machine's slower drift cancels), for the rounds where both ran with the right loss."""
    pairs = [(outcome(a, samples, reference)[0], outcome(b, samples, reference)[0]) for a, b in zip(ours, theirs)]
    return [a / b for a, b in pairs if a is not None and b is not None]


def run_rounds(num_stages, m, steps, rounds, peers, venv, schedules):
    """Every framework's run of every schedule, `rounds` times, the frameworks alternating within
    each schedule (zeroshard, then the peers asked for: torch, DeepSpeed's 1F1B), so that the
    machine's drift over the minutes a round takes falls on all alike.
    ({(framework, schedule): [run per round]}, why it stopped early or None)."""
    runs, number = {}, 0

    def record(framework, schedule, run):  # a run's list is made only once the run has returned
        runs.setdefault((framework, schedule), []).append(run)

    try:
        for number in range(1, rounds + 1):
            for schedule, v in schedules:
                record("zeroshard", schedule, spawn(zeroshard_rank, num_stages, m, steps, schedule, v))
                if "torch" in peers:
                    record("torch", schedule, spawn(torch_rank, num_stages, m, steps, schedule, v))
                if "deepspeed" in peers and schedule == "1f1b":
                    record("deepspeed", schedule, run_deepspeed(num_stages, m, steps, venv))
    except Stopped:
        return runs, f"stopped by SIGTERM in round {number} of {rounds}: the tables hold the runs that had finished"
    return runs, None


def print_losses(runs, reference):
    for (framework, schedule), per_round in runs.items():
        losses = [reported_loss(run) for run in per_round if "ranks" in run]
        failed = [run["error"] for run in per_round if "error" in run]
        if failed:
            print(f"  {framework:9} {schedule:16} {len(failed)} run(s) did not run: {failed[0][:100]}")
        if losses:
            worst = max(losses, key=lambda x: loss_error(x, reference))
            rel = loss_error(worst, reference)
            shown = "  ".join(f"{x:.7f}" for x in worst) if worst else "none"
            print(f"  {framework:9} {schedule:16} {shown}  rel {rel:.1e}  {'ok' if rel <= LOSS_RTOL else 'WRONG'}")


def print_schedule(schedule, num_stages, v, runs, peers, samples, reference, m, rounds):
    """One schedule's row: samples/s per framework, zeroshard's bubble split, and the details."""
    cells, notes = [], []
    for framework in ["zeroshard"] + [p for p in peers if (p, schedule) in runs]:
        text, failed = cell(runs[framework, schedule], samples, reference, rounds)
        cells.append(text)
        notes += [f"{framework}: {note[:160]}" for note in failed]
    cells += ["-"] * (3 - len(cells))  # a framework not asked for, or DeepSpeed beside 1F1B only
    found = []  # (round, bubbles) of zeroshard's rounds whose loss was right
    for number, run in enumerate(runs["zeroshard", schedule], start=1):
        if outcome(run, samples, reference)[0] is None:
            continue
        try:
            found.append((number, bubbles(schedule, num_stages, m, v, run["ranks"])))
        except Exception as error:  # noqa: BLE001 - shown in the table
            notes.append(f"bubble: {reason(error)}")
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
                f"{deep} stages {sim:.3f} (theory {th:.3f})" for deep, (sim, th) in b["deeper"].items()))
    shares = {framework: busy_shares([run for run in runs[framework, schedule] if outcome(run, samples, reference)[0]])
              for framework in ("zeroshard", "torch") if (framework, schedule) in runs}
    if any(shares.values()):
        print(f"{'':20}compute share of the step (per-rank compute over the slowest rank's step time, "
              "medians over steps, per round): " + "; ".join(
                  f"{framework} " + ", ".join(f"{x:.3f}" for x in values) for framework, values in shares.items() if values))
    usage = {framework: [u for u in (run_usage(run) for run in runs[framework, schedule]
                                     if outcome(run, samples, reference)[0]) if u]
             for framework in ["zeroshard"] + peers if (framework, schedule) in runs}
    if any(usage.values()):
        print(f"{'':20}per step, mean over ranks (per round): " + " / ".join(USAGE_FIELDS) + ": " + "; ".join(
            f"{framework} " + ", ".join("/".join(f"{x:.0f}" for x in u) for u in values)
            for framework, values in usage.items() if values))
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
    parser.add_argument("--pin", action="store_true", help="pin every framework's rank r to the same CPU: one per "
                        "physical core among this process's CPUs, spread evenly; refused when ranks exceed cores")
    parser.add_argument("--malloc-as-is", action="store_true", help="leave glibc's mmap and trim thresholds to "
                        "each rank process's allocation history (default: the same fixed ones in every framework's "
                        "ranks, pipeline_procs.MALLOC_ENV)")
    parser.add_argument("--dump", metavar="FILE", help="also write zeroshard's per-rank timelines and step times, "
                        "per schedule and round, as JSON (for reading the bubble offline)")
    args = parser.parse_args()
    num_stages, m, steps = args.stages, args.micro_batches, args.steps
    if num_stages not in (2, 4):
        raise SystemExit(f"--stages: got {num_stages}, expected 2 or 4 (the {LAYERS} blocks in stages x 2 "
                         "interleaved chunks)")
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
    if args.pin:
        pinned = pinned_cpus(num_stages)  # refuses before anything runs when there are too few cores
        os.environ[PIN_ENV] = ",".join(map(str, pinned))
    if args.dump and not os.access(os.path.dirname(os.path.abspath(args.dump)), os.W_OK):
        raise SystemExit(f"--dump: cannot write into the folder of {args.dump}")
    malloc = apply_malloc_env(args.malloc_as_is)
    reference = reference_loss(m)
    peers = [] if args.no_peers else ["torch", "deepspeed"]
    signal.signal(signal.SIGTERM, stop)
    runs, stopped = run_rounds(num_stages, m, steps, args.rounds, peers, args.deepspeed_venv, schedules)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.dump:  # first: the raw data survives a failure while printing
        with open(args.dump, "w") as f:
            json.dump({"stages": num_stages, "micro_batches": m, "pinned": pinned if args.pin else None,
                       "runs": {schedule: [{"verdict": outcome(run, samples, reference)[1] or "ok",
                                            "ranks": run.get("ranks")} for run in per_round]
                                for (framework, schedule), per_round in runs.items() if framework == "zeroshard"}}, f)
    schedules = [(name, v) for name, v in schedules if ("zeroshard", name) in runs]

    print(f"GPT: {LAYERS} blocks, d_model {D}, seq {SEQ}, micro-batch {MICRO}, {m} micro-batches per step, "
          f"{num_stages} stages (one process, one thread each; {len(os.sched_getaffinity(0))} CPUs), fp32, Gloo; "
          f"{steps} timed steps after a warm-up; {args.rounds} round(s), the frameworks alternating"
          + (f"; ranks pinned to CPUs {', '.join(map(str, pinned))} in rank order" if args.pin else "; not pinned")
          + f"; {malloc}")
    if stopped:
        print(f"STOPPED: {stopped} (a cell's k/{args.rounds} counts its rounds)")
    print(f"verified: each run's first- and second-step losses (the untimed warm-up, then after one Adam "
          f"step, lr {LR}, eps {EPS}) against a one-process torch.optim.Adam reference {reference[0]:.7f}  {reference[1]:.7f} "
          f"(same seeded weights, same data; within relative {LOSS_RTOL:g}); worst run:")
    print_losses(runs, reference)
    print(f"\n{'':18} {'samples/s (median over rounds, range)':^54} | "
          f"{'bubble fraction (medians over rounds; see below)':^56}")
    print(f"{'schedule':18} {'zeroshard':>17} {'torch':>17} {'deepspeed':>17} | {'theory':>7} {'list':>7} "
          f"{'+imbalance':>10} {'+runtime':>9} {'=measured':>9} {'-theory':>8}")
    for schedule, v in schedules:
        print_schedule(schedule, num_stages, v, runs, peers, samples, reference, m, args.rounds)
    print("\ntheory: the closed form at unit costs, free transfers ((p-1)/(m+p-1), divided by v interleaved, "
          "ZB-H1's for zero bubble); list: the executed lists simulated by the checker (_C.pipeline.simulate) "
          "at rank-averaged measured costs, free transfers; +imbalance: replayed at each (rank, chunk)'s own "
          "costs; +runtime: the rest of the measured bubble (transfers, Python; below 0 where buffered sends "
          "beat the checker's rendezvous); -theory: measured minus theory. theory, list, measured: medians "
          "over rounds; +imbalance, +runtime: differences of those medians. Few steps on shared cores: "
          "differences of a few 0.01 are noise")


if __name__ == "__main__":
    main()
