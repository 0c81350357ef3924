"""bench/pipeline.py's bubble arithmetic: the closed forms, the measured bubble of one step's
timelines, the measured costs, and the executed lists simulated (by the checker, _C.pipeline.simulate)
and replayed at each rank's own costs. A timeline is one rank's [(op, micro_batch, chunk, start_s,
end_s)] for one step, an entry per instruction and per wait for received data; p stages, m
micro-batches, v chunks per rank."""
import statistics

from zeroshard.pipe.list_run import WAIT_NAMES

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
SENDS, RECEIVES = ("send_activation", "send_gradient"), ("receive_activation", "receive_gradient")
WAITS = set(WAIT_NAMES.values())  # a timeline's waits for received data, timed apart from the instructions


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
            if (other is None or other[0] not in SENDS + RECEIVES or other[3] != r
                    or (other[0] in SENDS) == (op in SENDS)):
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
    (median over steps), the costs, and the lists' bubble simulated at 4 and 8 stages where deeper
    than p."""
    from zeroshard import _C
    lists = _C.pipeline.build(schedule, p, m, v)[0]
    timelines = [r["timelines"] for r in ranks]
    for rank, (lst, steps) in enumerate(zip(lists, timelines)):
        planned = [i[:3] for i in lst if i[0] != "optimizer_step"]
        if any([t[:3] for t in tl if t[0] not in WAITS] != planned for tl in steps):
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
