"""Runs one rank's instruction list (built and checked in C++: pipeline/schedule.h), whatever it is
for: what TrainStep (executor.py) and EvalStep (evaluate.py) share, the loads, the receives (each
waited for where its data is used), failure reports naming the stage, and the end of the sends."""
from zeroshard import _C


class ListRun:
    OPS = ()         # the instructions a subclass's lists hold, each one of its methods
    USES = {"forward": "receive_activation"}  # a computation -> the receive whose data it waits for
    AFTER_THE_LIST = ()  # instructions its caller carries out once the list has run
    REPORT_SUFFIX = ""  # after the instruction in failure reports (" (eval)")
    RECORDS = False  # whether the benchmark's timeline and the trace see the instructions

    def __init__(self, engine, data_iter):
        self.engine = engine
        self.module = engine.module
        self.links = engine._links
        self.data_iter = data_iter if engine._needs_data() else None  # only the first and last stages read
        self.last_stage = self.module.num_global_stages - 1  # the global stage that computes the loss
        self.batches = {}  # mb -> [inputs, labels]: this rank's parts (_take)
        self.receiving = {}  # (receive op, mb, chunk) -> a receive started and not yet waited for
        self.inputs = {}   # (mb, chunk) -> the received tensors (_arrived), for the forward and after

    def run(self, instructions):
        """Runs the list: each instruction is the method of its name, and a computation that uses
        a receive's data waits for it first (USES), as torch.distributed.pipelining's schedules
        wait at the forward or backward. So on Gloo a rank whose list reads "receive the next
        activation, send this gradient" sends before it waits; not where the activation's layout
        travels with it (a boundary's first micro-batch, every one with dynamic_shape), which is
        received at its instruction. On NCCL a wait only orders the GPU stream, and the transfers
        between two ranks run on one stream in issue order, so there the gradient still leaves
        after the activation arrives.

        This cannot deadlock a list the checker passed (pipeline/schedule_check.h), which proves
        them under sends that block until received: the lists are projections of one order of
        transfers (between two ranks in the same order on both sides), with the tie and
        data-parallel collectives last on every rank. Every receive is started no later than its
        place in the list, the backend moves a started transfer on its own (Gloo's threads,
        NCCL's stream), and a rank only ever waits for a transfer placed at or before where it
        stands (a receive before the computation that uses it, a send older than the ones it
        issues, a layout at its own instruction). Were ranks stuck, the earliest unfinished
        transfer in that order would have both ends started (a rank that has not started its end
        stands at or before it, so waits for that transfer or an earlier one), and so would
        finish."""
        handlers = {op: getattr(self, op) for op in self.OPS}
        ahead = receives_ahead(instructions) if self.links.posts_ahead else {}
        timeline = self.engine._timeline if self.RECORDS else None  # a list when the benchmark records
        observer = self.engine._observer if self.RECORDS and self.engine._observer.wants_instructions else None
        for i, (op, mb, chunk, peer) in enumerate(instructions):
            for j in ahead.get(i, ()):
                self._post(*instructions[j])
            if op in self.AFTER_THE_LIST:
                continue
            used = self.USES.get(op)
            if (used, mb, chunk) in self.receiving:  # a receive this instruction needs the data of
                self._timed(self._wait, timeline, observer, WAIT_NAMES[used], mb, chunk, used)
            self._timed(handlers[op], timeline, observer, op, mb, chunk, peer)
        # A checked list uses every receive: a leftover would meet a later step's message.
        with self.engine._stage_failure_reported(
                f"pipeline stage {self.module.stage_id} end of its list{self.REPORT_SUFFIX}"):
            if self.receiving:
                raise RuntimeError(f"pipeline: receives started and never used: {sorted(self.receiving)}")
        # The sends are done before their tensors may be reused. A rank that meets another
        # stage's failure here names it (see PipelineEngine._named_by_world).
        with self.engine._named_by_world(f"last sends{self.REPORT_SUFFIX}"):
            self.links.finish()

    @staticmethod
    def _timed(call, timeline, observer, name, mb, chunk, *args):
        """call(mb, chunk, *args), timed for the benchmark's timeline and the observer when they
        want it."""
        if timeline is None and observer is None:
            call(mb, chunk, *args)
            return
        start = _C.trace.now_ns()
        call(mb, chunk, *args)
        end = _C.trace.now_ns()
        if timeline is not None:
            timeline.append((name, mb, chunk, start / 1e9, end / 1e9))
        if observer is not None:
            observer.instruction(name, mb, chunk, start, end)

    def _reported(self, op, mb, chunk):
        """Around this rank's own work: an error is published, naming the stage, the instruction
        and the micro-batch, before it propagates (PipelineEngine._stage_failure_reported)."""
        stage = self.module.global_stage(chunk)
        return self.engine._stage_failure_reported(
            f"pipeline stage {stage} {op}{self.REPORT_SUFFIX} of micro-batch {mb}")

    def _peer(self, peer):
        return self.engine._grid.stage_to_global(peer)

    def load_micro_batch(self, mb, chunk, peer):
        with self._reported("load_micro_batch", mb, chunk):
            self.batches[mb] = list(self.engine._next_micro_batch(self.data_iter, mb))

    def _take(self, mb, part):
        """Micro-batch mb's inputs (part 0, the first stage's) or labels (1, the last stage's);
        each is used by one forward, so it is let go there, and the micro-batch once this rank
        has used all it holds of it."""
        batch = self.batches[mb]
        value, batch[part] = batch[part], None
        if all(x is None for x in batch):
            del self.batches[mb]
        return value

    def _stage_input(self, mb, chunk, received):
        """What a forward takes: on the first stage the micro-batch's inputs, else `received()`,
        the tensors that came from the stage before (one of them unpacked from its tuple)."""
        if self.module.global_stage(chunk) == 0:
            return self._take(mb, 0)
        tensors = received()
        return tensors[0] if len(tensors) == 1 else tensors

    def _post(self, op, mb, chunk, peer):
        """Starts a later receive now, so that its data arrives while this rank computes; left to
        its instruction where its layout or the outputs a gradient is for are not known yet."""
        described = self._receive_of(op, mb, chunk)
        if described is None:
            return
        kind, stage, like = described
        posted = self.links.post(kind, stage, mb, self._peer(peer), like=like)
        if posted is not None:
            self.receiving[(op, mb, chunk)] = posted

    def _receive(self, op, mb, chunk, peer):
        """A receive instruction: starts the transfer unless it was started ahead. The instruction
        that uses the data waits for it (run)."""
        if (op, mb, chunk) not in self.receiving:
            described = self._receive_of(op, mb, chunk)
            if described is None:
                with self._reported(op, mb, chunk):
                    raise RuntimeError(f"pipeline: {op} of micro-batch {mb} chunk {chunk} comes before the "
                                       "forward whose outputs it is for (the list was not built by "
                                       "pipeline/schedule.cpp)")
            kind, stage, like = described
            self.receiving[(op, mb, chunk)] = self.links.start_receive(kind, stage, mb, self._peer(peer), like=like)

    def receive_activation(self, mb, chunk, peer):
        self._receive("receive_activation", mb, chunk, peer)

    def _wait(self, mb, chunk, op):
        """Waits for the receive (op, mb, chunk) and hands its tensors to _arrived."""
        self._arrived(op, mb, chunk, self.receiving.pop((op, mb, chunk)).wait())

    def _receive_of(self, op, mb, chunk):
        """(kind, the global stage it enters, like) of a receive, or None while it cannot be
        started: here an activation's (a subclass adds gradients, like being the outputs they are
        for)."""
        return "activation", self.module.global_stage(chunk), None

    def _arrived(self, op, mb, chunk, tensors):
        """Keeps a received activation as the input of micro-batch mb's forward on chunk."""
        self.inputs[(mb, chunk)] = tensors


_COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
# How a wait for a receive's data (ListRun.USES) shows in the benchmark's timeline and the trace.
WAIT_NAMES = {"receive_activation": "wait_activation", "receive_gradient": "wait_gradient"}


def receives_ahead(instructions):
    """index of a compute instruction -> the receives between it and the next compute, which
    run() starts before that computation (their data arrives while it runs)."""
    ahead, current = {}, None
    for i, (op, *_rest) in enumerate(instructions):
        if op in _COMPUTE:
            current = i
        elif op.startswith("receive_") and current is not None:
            ahead.setdefault(current, []).append(i)
    return ahead
