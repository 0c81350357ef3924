"""The per-rank trace in the Chrome trace event format (Perfetto, chrome://tracing): zeroshard's
`trace` block ({"enabled": true, "output_path": ..., "steps": [3, 4]}) or ZEROSHARD_TRACE=<dir>
(with ZEROSHARD_TRACE_STEPS=3,4). While a traced step runs, C++ records every collective (issue to
completion, with its sequence number, bytes and group), each wait that blocked the rank, gathers,
copies, disk I/O and optimizer sub-group steps, and the memory accounting's bytes by category;
this file adds each module's forward and backward, the pipeline's instructions and the process's
resident memory. When the traced steps end, each rank writes <output_path>/trace_rank<r>.json and
rank 0 writes trace_merged.json, the ranks as separate processes, each rank's clock starting at a
barrier all ranks passed together. Steps [] traces until the engine ends (files at exit, merged
by zeroshard-report)."""
import gc
import json
import os

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.graph import lowest_nodes_created
from zeroshard.log import log_rank0

TRACK_NAMES = {0: "main"}


def settings(config):
    """The trace block in force: the config's, or ZEROSHARD_TRACE's when that is set."""
    block = dict(config.get("trace") or {})
    env = os.environ.get("ZEROSHARD_TRACE")
    if env:
        block.update(enabled=True, output_path=env)
        steps = os.environ.get("ZEROSHARD_TRACE_STEPS", "")
        try:
            block["steps"] = [int(s) for s in steps.split(",") if s.strip()]
        except ValueError:
            block["steps"] = None
        if block["steps"] is None or not consecutive(block["steps"]):
            raise ValueError(f"ZEROSHARD_TRACE_STEPS: got {steps!r}, expected consecutive step numbers >= 1 "
                             "such as 3,4 (or unset: every step)")
    return block


def consecutive(steps):
    """The trace block's rule for steps (runtime/config/features.cpp checks the config's)."""
    return all(s >= 1 for s in steps) and sorted(steps) == list(range(min(steps), min(steps) + len(steps))) \
        if steps else True


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _ModuleSpans:
    """Forward and backward spans of every module, from hooks that add nothing to the graph:
    a backward starts when the first gradient reaches the forward's outputs and ends when the
    lowest autograd nodes its forward created have run (zeroshard.graph)."""

    def __init__(self, module, record, bounded):
        self._record = record
        self._open = {}  # id(module) -> [(start_ns, first autograd sequence number)]
        self._node_starts = {}  # id(autograd node) -> (node, [first gradient's time]), this step's
        self._handles = []
        # The hooks below allocate per module and micro-step, which sets off the garbage
        # collector's full passes over the whole heap (torch's objects included): frozen, the
        # heap that was there before the trace is left out of them until the trace ends. Garbage
        # is collected first, so that the freeze keeps little: in a window of listed steps the
        # young generations' only (the last steps' cycles; a full pass costs a window's start
        # most of its time, bench/RESULTS.md), so the oldest generation's garbage is kept at
        # least until the window ends, then waits for the next full pass as it would untraced; in
        # an open window (steps []), which may last the whole run, all of it. Not when the script froze a heap itself: unfreezing would undo its
        # freeze too. The freeze is the process's: a second trace in the process finds it taken
        # and leaves it to the first.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.collect(1 if bounded else 2)
            gc.freeze()
        for name, m in module.named_modules():
            label = name or type(module).__name__
            self._handles.append(m.register_forward_pre_hook(lambda mod, args: self._pre(mod)))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out, label=label: self._post(mod, out, label)))

    def _pre(self, module):
        self._open.setdefault(id(module), []).append((_C.trace.now_ns(), _C.autograd_sequence_number()))

    def _post(self, module, output, label):
        stack = self._open.get(id(module))
        if not stack:
            return
        start_ns, first = stack.pop()
        end_ns = _C.trace.now_ns()
        backward = torch._C._current_graph_task_id() != -1  # a recomputation (checkpointing)
        self._record("module", f"{'recompute' if backward else 'forward'} {label}", start_ns, end_ns)
        if not torch.is_grad_enabled():
            return
        outs = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
        lowest = lowest_nodes_created(outs, first, _C.autograd_sequence_number()) if outs else None
        if not lowest:
            return
        starts = [self._start_of(node) for node in {t.grad_fn for t in outs}]
        left = [len(lowest)]

        def ran(grad_inputs, grad_outputs):
            left[0] -= 1
            begun = [s[0] for s in starts if s[0] is not None]
            if left[0] == 0 and begun:
                self._record("module", f"backward {label}", min(begun), _C.trace.now_ns())

        for node in lowest:
            node.register_hook(ran)

    def _start_of(self, node):
        """The time the first gradient reached `node`, shared by every module whose output it
        made (a container returning its last child's output): their backward spans start
        together and nest."""
        entry = self._node_starts.get(id(node))
        if entry is None or entry[0] is not node:
            cell = [None]

            def began(grad_outputs):
                if cell[0] is None:
                    cell[0] = _C.trace.now_ns()

            node.register_prehook(began)
            entry = self._node_starts[id(node)] = (node, cell)
        return entry[1]

    def new_step(self):
        self._node_starts = {}

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._froze:
            gc.unfreeze()
            self._froze = False


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class Trace:
    def __init__(self, block, module, memory, all_ranks_comm, rank, world_size):
        """all_ranks_comm(): the communicator of every rank (the trace's start barrier)."""
        self._dir = block.get("output_path") or "zeroshard_trace"
        self._steps = set(int(s) for s in block.get("steps") or [])
        self._bounded = bool(self._steps)  # the window ends at a listed step, not with the engine
        self._max_events = int(block.get("max_events") or 2_000_000)
        self._module, self._memory, self._comm = module, memory, all_ranks_comm
        self._rank, self._world = rank, world_size
        self._spans = None
        self._t0 = None
        self._done = False
        _C.trace.track()  # the first thread to ask is track 0, "main": this one

    @property
    def recording(self):
        return self._spans is not None

    def record(self, category, name, start_ns, end_ns, args=""):
        if self._spans is not None:  # into the runtime's one buffer, which max_events bounds
            _C.trace.span(category, name, start_ns, end_ns, args)

    # ----- the traced window -----
    def step_begins(self, step):
        """Before step `step` (1 = the first) runs on every rank."""
        wanted = not self._steps or step in self._steps
        if wanted and not self.recording and not self._done:
            self._start()
        elif not wanted and self.recording:
            self._finish(merge=True)
        if self.recording:
            self._spans.new_step()

    def step_ends(self, step):
        """After step `step`: the last listed step writes the trace at once."""
        if self.recording and self._steps and step >= max(self._steps):
            self._finish(merge=True)

    def _start(self):
        self._comm().barrier("trace start")  # every rank's clock starts at the same moment
        self._t0 = _C.trace.now_ns()
        _C.trace.start(self._max_events)
        self._memory.trace_sample()
        self._spans = _ModuleSpans(self._module, self.record, bounded=self._bounded)

    def sample_process(self):
        if self.recording:
            _C.trace.counter("process bytes", f'"resident": {_rss_bytes()}' + (
                f', "torch_allocated": {torch.cuda.memory_allocated()}' if torch.cuda.is_available() else ""))

    def _finish(self, merge):
        self._spans.remove()
        self._spans = None
        _C.trace.stop()
        events = sorted(_C.trace.drain(), key=lambda e: e[3])
        self._done = True
        dropped = _C.trace.dropped()
        os.makedirs(self._dir, exist_ok=True)
        mine = to_chrome(events, self._rank, self._t0)
        path = os.path.join(self._dir, f"trace_rank{self._rank}.json")
        _write(path, {"traceEvents": mine, "displayTimeUnit": "ms",
                      "otherData": {"rank": self._rank, "world_size": self._world, "dropped_events": dropped}})
        if dropped:
            log_rank0(f"warning: trace: {dropped} events over trace.max_events {self._max_events} were "
                      "not kept", self._rank)
        if merge and self._world > 1 and dist.is_initialized():
            gathered = [None] * self._world if self._rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if self._rank == 0:
                merged = [e for per_rank in gathered for e in per_rank]
                _write(os.path.join(self._dir, "trace_merged.json"),
                       {"traceEvents": merged, "displayTimeUnit": "ms",
                        "otherData": {"world_size": self._world}})
        elif merge and self._rank == 0:
            _write(os.path.join(self._dir, "trace_merged.json"),
                   {"traceEvents": mine, "displayTimeUnit": "ms", "otherData": {"world_size": 1}})
        log_rank0(f"trace written to {self._dir}/ (trace_rank<r>.json per rank"
                  f"{', trace_merged.json' if merge else ''})", self._rank)

    def close(self):
        """At the engine's end: a trace still recording (steps []) is written, unmerged."""
        if self.recording:
            self._finish(merge=False)


def _write(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def to_chrome(events, rank, t0_ns):
    """Chrome trace events of one rank: process `rank`, timestamps in µs from t0_ns. Collectives
    and disk requests overlap each other and the compute, so they are async slices (b/e);
    everything else a complete slice (X) on its thread's track, or a counter (C)."""
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    tracks = set()
    for phase, category, name, start_ns, duration_ns, track, args in events:
        ts = (start_ns - t0_ns) / 1e3
        fields = json.loads("{" + args + "}") if args else {}
        tracks.add(track)
        if phase == "C":
            out.append({"ph": "C", "name": name, "cat": category, "pid": rank, "tid": track, "ts": ts,
                        "args": fields})
        elif category in ("comm", "io"):
            # A collective is keyed by its group and number; a disk request by its place here.
            key = f"{fields.get('group', '')}:{fields['seq']}" if category == "comm" else f"io:{len(out)}"
            common = {"name": name, "cat": category, "pid": rank, "tid": track, "id": key}
            out.append({**common, "ph": "b", "ts": ts, "args": fields})
            out.append({**common, "ph": "e", "ts": ts + duration_ns / 1e3})
        else:
            out.append({"ph": "X", "name": name, "cat": category, "pid": rank, "tid": track, "ts": ts,
                        "dur": duration_ns / 1e3, "args": fields})
    for track in sorted(tracks):
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": track,
                    "args": {"name": TRACK_NAMES.get(track, f"thread {track}")}})
    return out
