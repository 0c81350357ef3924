"""What bench/pipeline.py's ranks measure besides their step time, and its report's reductions of those
(and --pin's choice of CPUs): torch's compute (its stage forwards and autograd calls, timed by
wrapping them), each rank's main-thread preemptions, page faults and CPU time per step and its
process's CPU time, the compute share of a
step for zeroshard (from its timestamped instructions) and torch, and the usage means over a run's
ranks."""
import os
import resource
import statistics
import time

import torch

from pipeline_bubbles import COMPUTE


def time_torch_compute(modules):
    """[seconds] that torch's stages spend in forward (the stage modules' own) and in autograd's
    backward and grad (what pipelining's stage_backward* call), summed until reset: its compute,
    to set beside zeroshard's timestamped compute instructions."""
    total, started = [0.0], {}

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - t0
        return call

    torch.autograd.backward, torch.autograd.grad = timed(torch.autograd.backward), timed(torch.autograd.grad)
    for module in modules:
        module.register_forward_pre_hook(lambda mod, args: started.__setitem__(id(mod), time.perf_counter()))
        module.register_forward_hook(
            lambda mod, args, out: total.__setitem__(0, total[0] + time.perf_counter() - started.pop(id(mod))))
    return total


USAGE_FIELDS = ("involuntary context switches", "minor page faults", "main-thread CPU ms", "process CPU ms")


def thread_usage(since=None):
    """USAGE_FIELDS of this rank: its main thread's involuntary context switches, minor page faults
    and CPU time (the step's compute runs on it, so preemption, fresh pages and extra work show
    here), and the CPU time of all its threads (Gloo's, the runtime's). A pass that takes longer
    in wall time but not in CPU time waited off its core; one that takes more CPU time did more
    work or ran slower on its core. With `since`, the counts since that reading."""
    u = resource.getrusage(resource.RUSAGE_THREAD)
    s = resource.getrusage(resource.RUSAGE_SELF)
    now = (u.ru_nivcsw, u.ru_minflt, 1e3 * (u.ru_utime + u.ru_stime), 1e3 * (s.ru_utime + s.ru_stime))
    return now if since is None else tuple(a - b for a, b in zip(now, since))


def median_usage(per_step):
    return [statistics.median(x[i] for x in per_step) for i in range(len(USAGE_FIELDS))] if per_step else None


def busy_shares(runs):
    """Per run (the rounds whose losses were right): the ranks' mean compute per step over the
    slowest rank's step time, 1 - a bubble measured the same way for zeroshard (its timestamped
    compute instructions) and torch (its stage forwards and autograd calls, time_torch_compute)."""
    out = []
    for run in runs:
        ranks = run["ranks"]
        if "compute_s" in ranks[0]:
            compute = [r["compute_s"] for r in ranks]
        elif "timelines" in ranks[0]:
            compute = [statistics.median(sum(t[4] - t[3] for t in tl if t[0] in COMPUTE) for tl in r["timelines"])
                       for r in ranks]
        else:
            continue
        out.append(statistics.mean(compute) / max(r["step_s"] for r in ranks))
    return out


def run_usage(run):
    """USAGE_FIELDS per step, means over the run's ranks, or None."""
    ranks = run.get("ranks") or []
    if not ranks or any(r.get("usage") is None for r in ranks):
        return None
    return tuple(statistics.mean(r["usage"][i] for r in ranks) for i in range(len(USAGE_FIELDS)))


def pinned_cpus(ranks):
    """--pin's CPU per rank: one per physical core while there are enough (a core's second hardware
    thread would share its units with another rank), spread evenly over them; else SystemExit."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = {}
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f1, \
                    open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f2:
                key = (f2.read().strip(), f1.read().strip())
        except OSError:
            key = ("", str(cpu))
        cores.setdefault(key, cpu)  # the core's first CPU
    one_per_core = sorted(cores.values())
    if ranks > len(one_per_core):
        raise SystemExit(f"--pin: {ranks} ranks but {len(one_per_core)} physical cores among this process's "
                         f"{len(cpus)} CPUs; drop --pin or use fewer --stages")
    return [one_per_core[r * len(one_per_core) // ranks] for r in range(ranks)]
