"""zeroshard-report TRACE [--out DIR] [--timeline]: reads a trace that zeroshard wrote (a file, or
the trace directory: trace_merged.json, else every trace_rank<r>.json in it) and prints, per rank
and traced step, the step time split by phase (forward, backward, optimizer step), the exposed
communication (time the rank spent blocked in a collective's wait, against the time any collective
was in flight), the largest gathers, the peak of the model state the runtime accounts with what
held it, and the peaks of the process's resident memory (and torch's allocated bytes on CUDA) split
into the accounted model state and the rest (activations, temporaries, ...); then draws
<out>/memory_rank<r>.png (device and host bytes by category over time, the phases below them) and,
with --timeline, <out>/timeline.png (every rank's phases, collectives and waits side by side)."""
import argparse
import glob
import json
import os
import sys

PHASES = ("forward", "backward", "step")
DEVICE_CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state",
                     "gathered_parameters", "comm_buffers")
HOST_CATEGORIES = ("host_parameters", "host_master_weights", "host_optimizer_state", "host_buffers")


def load(path):
    """Chrome trace events of every rank in `path` (a file or a trace directory)."""
    if os.path.isdir(path):
        merged = os.path.join(path, "trace_merged.json")
        per_rank = sorted(glob.glob(os.path.join(path, "trace_rank*.json")))
        # The merged file, unless a rank's file is newer (a later run that wrote no merged file).
        fresh = os.path.exists(merged) and all(os.path.getmtime(f) <= os.path.getmtime(merged) for f in per_rank)
        files = [merged] if fresh else per_rank
        if not files:
            raise SystemExit(f"zeroshard-report: {path} holds no trace_merged.json or trace_rank<r>.json")
    else:
        files = [path]
    events = []
    for name in files:
        try:
            with open(name) as f:
                events += json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"zeroshard-report: {name}: not a zeroshard trace ({error})")
    return events


def _by_rank(events):
    ranks = {}
    for e in events:
        if e.get("ph") != "M":
            ranks.setdefault(e["pid"], []).append(e)
    return dict(sorted(ranks.items()))


def _within(e, start, end):
    return e["ts"] >= start - 1e-3 and e["ts"] + e.get("dur", 0) <= end + 1e-3


def _overlap(e, start, end):
    """How much of span `e` falls inside [start, end] (a collective may cross a step's edge)."""
    return max(0.0, min(e["ts"] + e.get("dur", 0), end) - max(e["ts"], start))


def _covered(spans, start, end):
    """How long at least one of `spans` is in flight within [start, end] (their union, not
    their sum: prefetched collectives overlap one another)."""
    total, reach = 0.0, start
    for e in sorted(spans, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], reach), min(e["ts"] + e.get("dur", 0), end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def _comm_spans(events):
    """Async collective slices (b/e pairs keyed by id) as {name, ts, dur, args}."""
    begins, spans = {}, []
    for e in events:
        if e.get("cat") != "comm":
            continue
        if e["ph"] == "b":
            begins[e["id"]] = e
        elif e["ph"] == "e" and e["id"] in begins:
            b = begins.pop(e["id"])
            spans.append({"name": b["name"], "ts": b["ts"], "dur": e["ts"] - b["ts"], "args": b.get("args", {})})
    return spans


def step_summaries(events):
    """Per traced step of one rank: its time, its phases, exposed and total communication (ms)."""
    steps = sorted((e for e in events if e.get("cat") == "step" and e["ph"] == "X"), key=lambda e: e["ts"])
    comm = _comm_spans(events)
    out = []
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in events if e["ph"] == "X" and _within(e, start, end)]
        phases = {p: sum(e["dur"] for e in inside if e.get("cat") == "phase" and e["name"] == p) / 1e3
                  for p in PHASES}
        exposed = sum(_overlap(e, start, end) for e in events if e["ph"] == "X" and e.get("cat") == "wait") / 1e3
        total_comm = _covered([c for c in comm if _overlap(c, start, end) > 0], start, end) / 1e3
        out.append({"name": s["name"], "step_ms": s["dur"] / 1e3, "phases_ms": phases,
                    "exposed_comm_ms": exposed, "comm_ms": total_comm})
    return out


def memory_peak(events):
    """(peak device bytes of the model state, {category: bytes at that peak}, time in µs)."""
    best = (-1, {}, 0.0)
    for e in events:
        if e["ph"] == "C" and e["name"] == "model state bytes":
            total = sum(e["args"].get(c, 0) for c in DEVICE_CATEGORIES)
            if total > best[0]:
                best = (total, dict(e["args"]), e["ts"])
    return best


def process_peaks(events):
    """The peaks of what the process itself held, from its counters: resident memory, and on CUDA
    torch's allocated bytes. Each is {"bytes", "ts", "accounted", "rest"}: the model state the
    runtime accounted in that memory at the last sample before the peak (on CUDA the host
    categories in resident memory, the device ones in torch's; on CPU every category is in
    resident memory), and the rest (activations, temporaries; for resident memory also Python,
    torch and the libraries)."""
    process = sorted((e for e in events if e["ph"] == "C" and e["name"] == "process bytes"), key=lambda e: e["ts"])
    states = sorted((e for e in events if e["ph"] == "C" and e["name"] == "model state bytes"), key=lambda e: e["ts"])
    on_cuda = any("torch_allocated" in e["args"] for e in process)
    peaks = {}
    for key, categories in (("resident", HOST_CATEGORIES if on_cuda else DEVICE_CATEGORIES + HOST_CATEGORIES),
                            ("torch_allocated", DEVICE_CATEGORIES)):
        samples = [e for e in process if key in e["args"]]
        if not samples:
            continue
        top = max(samples, key=lambda e: e["args"][key])
        before = [e for e in states if e["ts"] <= top["ts"]]
        held = before[-1]["args"] if before else {}
        accounted = sum(held.get(c, 0) for c in categories)
        peaks[key] = {"bytes": top["args"][key], "ts": top["ts"], "accounted": accounted,
                      "rest": top["args"][key] - accounted}
    return peaks


# process_peaks' keys: the summary's title and what "the rest" holds.
_PEAK_LABELS = {"torch_allocated": ("peak torch allocated", "activations and temporaries"),
                "resident": ("peak resident memory", "activations, temporaries, Python, torch and libraries")}


def _mb(nbytes):
    return f"{nbytes / 1e6:.2f} MB"


def summarize(events, top=5):
    lines = []
    for rank, evs in _by_rank(events).items():
        lines.append(f"rank {rank}:")
        for s in step_summaries(evs):
            phases = s["phases_ms"]
            other = s["step_ms"] - sum(phases.values())
            lines.append(f"  {s['name']}: {s['step_ms']:.1f} ms = " +
                         " + ".join(f"{p} {phases[p]:.1f}" for p in PHASES) + f" + other {other:.1f}")
            share = (f" ({100 * s['exposed_comm_ms'] / s['comm_ms']:.0f}% of the time collectives were in flight)"
                     if s["comm_ms"] else "")
            lines.append(f"    exposed communication {s['exposed_comm_ms']:.1f} ms{share}; at least one "
                         f"collective in flight {s['comm_ms']:.1f} ms")
        gathers = sorted((c for c in _comm_spans(evs) if c["args"].get("op") == "all_gather"),
                         key=lambda c: c["args"].get("bytes", 0), reverse=True)[:top]
        if gathers:
            lines.append("  largest gathers: " + "; ".join(
                f"{g['name']} {_mb(g['args'].get('bytes', 0))} in {g['dur'] / 1e3:.2f} ms" for g in gathers))
        peak, held, when = memory_peak(evs)
        if peak >= 0:
            parts = ", ".join(f"{c} {_mb(held.get(c, 0))}" for c in DEVICE_CATEGORIES if held.get(c))
            lines.append(f"  peak model state {_mb(peak)} at {when / 1e3:.1f} ms: {parts}")
        for key, p in process_peaks(evs).items():
            title, rest = _PEAK_LABELS[key]
            lines.append(f"  {title} {_mb(p['bytes'])} at {p['ts'] / 1e3:.1f} ms: accounted model state "
                         f"{_mb(p['accounted'])}, the rest ({rest}) {_mb(p['rest'])}")
    return "\n".join(lines)


def _pyplot():
    """matplotlib's pyplot, headless; its absence is said with the fix (the summary needs none)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("drawing the PNGs needs the matplotlib package, which is not installed: "
                          "pip install matplotlib (or pip install zeroshard[report])") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_memory(events, out_dir):
    plt = _pyplot()
    written = []
    for rank, evs in _by_rank(events).items():
        samples = sorted((e for e in evs if e["ph"] == "C" and e["name"] == "model state bytes"),
                         key=lambda e: e["ts"])
        process = sorted((e for e in evs if e["ph"] == "C" and e["name"] == "process bytes"), key=lambda e: e["ts"])
        fig, (top, host, bottom) = plt.subplots(3, 1, figsize=(11, 8), sharex=True,
                                                gridspec_kw={"height_ratios": [3, 2, 1]})
        if samples:
            t = [e["ts"] / 1e3 for e in samples]
            series = [[e["args"].get(c, 0) / 1e6 for e in samples] for c in DEVICE_CATEGORIES]
            top.stackplot(t, series, labels=DEVICE_CATEGORIES, step="post")
            if process and "torch_allocated" in process[0]["args"]:
                top.step([e["ts"] / 1e3 for e in process], [e["args"]["torch_allocated"] / 1e6 for e in process],
                         where="post", color="black", label="torch allocated (activations included)")
            top.legend(loc="upper left", fontsize=8)
            series = [[e["args"].get(c, 0) / 1e6 for e in samples] for c in HOST_CATEGORIES]
            host.stackplot(t, series, labels=HOST_CATEGORIES, step="post")
        if process:
            host.step([e["ts"] / 1e3 for e in process], [e["args"]["resident"] / 1e6 for e in process],
                      where="post", color="black", label="process resident (RSS)")
        host.legend(loc="upper left", fontsize=8)
        host.set_ylabel("host (MB)")
        top.set_ylabel("model state (MB)")
        top.set_title(f"rank {rank}: memory by category")
        colors = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green", "wait": "tab:red"}
        for e in evs:
            kind = e["name"] if e.get("cat") == "phase" else ("wait" if e.get("cat") == "wait" else None)
            if e["ph"] == "X" and kind in colors:
                row = 1 if kind == "wait" else 0
                bottom.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (row, 0.8), color=colors[kind])
        bottom.set_yticks([0.4, 1.4], ["phases", "waits"])
        bottom.set_xlabel("ms since the trace started")
        path = os.path.join(out_dir, f"memory_rank{rank}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plot_timeline(events, out_dir):
    """Every rank's phases, collectives in flight and waits, one band each: a headless picture of
    what Perfetto shows."""
    plt = _pyplot()
    ranks = _by_rank(events)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(ranks)))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green"}
    labels, y = [], 0
    for rank, evs in ranks.items():
        for e in evs:
            if e["ph"] == "X" and e.get("cat") == "phase":
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + 0.66, 0.3), color=colors.get(e["name"], "grey"))
            elif e["ph"] == "X" and e.get("cat") == "wait":
                ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (y + 0.0, 0.3), color="tab:red")
        for c in _comm_spans(evs):
            ax.broken_barh([(c["ts"] / 1e3, max(c["dur"] / 1e3, 1e-3))], (y + 0.33, 0.3), color="tab:purple", alpha=0.5)
        labels.append((y + 0.5, f"rank {rank}"))
        y += 1.2
    ax.set_yticks([p for p, _ in labels], [n for _, n in labels])
    ax.set_xlabel("ms since the trace started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red")]
    ax.legend(handles, ["forward", "backward", "step", "collective in flight", "wait (exposed)"],
              loc="upper center", ncol=5, fontsize=8, bbox_to_anchor=(0.5, 1.12))
    fig.tight_layout()
    path = os.path.join(out_dir, "timeline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="zeroshard-report", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace file, or the trace directory")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: the trace's directory)")
    parser.add_argument("--timeline", action="store_true", help="also draw timeline.png (all ranks)")
    args = parser.parse_args(argv)
    events = load(args.trace)
    print(summarize(events))
    out = args.out or (args.trace if os.path.isdir(args.trace) else os.path.dirname(args.trace) or ".")
    os.makedirs(out, exist_ok=True)
    try:
        for path in plot_memory(events, out):
            print(f"wrote {path}")
        if args.timeline:
            print(f"wrote {plot_timeline(events, out)}")
    except ImportError as error:  # the summary above needed nothing more
        print(f"zeroshard-report: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
