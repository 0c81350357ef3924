"""What running one rank's instruction list (built and checked in C++: pipeline/schedule.h) takes,
whatever the list is for: each instruction is the method of the same name on a subclass (TrainStep
in executor.py, EvalStep in evaluate.py); the data loads; receives started ahead of their
instruction; failure reports that name the stage and the micro-batch; and the end of the sends."""
from zeroshard import _C


class ListRun:
    OPS = ()         # the instructions a subclass's lists hold, each one of its methods
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
        self.posted = {}   # (receive op, mb, chunk) -> a receive started ahead of its instruction

    def run(self, instructions):
        handlers = {op: getattr(self, op) for op in self.OPS}
        ahead = receives_ahead(instructions) if self.links.posts_ahead else {}
        timeline = self.engine._timeline if self.RECORDS else None  # a list when the benchmark records
        observer = self.engine._observer if self.RECORDS and self.engine._observer.wants_instructions else None
        for i, (op, mb, chunk, peer) in enumerate(instructions):
            for j in ahead.get(i, ()):
                self._post(*instructions[j])
            if op in self.AFTER_THE_LIST:
                continue
            if timeline is None and observer is None:
                handlers[op](mb, chunk, peer)
                continue
            start = _C.trace.now_ns()
            handlers[op](mb, chunk, peer)
            end = _C.trace.now_ns()
            if timeline is not None:
                timeline.append((op, mb, chunk, start / 1e9, end / 1e9))
            if observer is not None:
                observer.instruction(op, mb, chunk, start, end)
        # The sends are done before their tensors may be reused. A rank that meets another
        # stage's failure here names it (see PipelineEngine._named_by_world).
        with self.engine._named_by_world(f"last sends{self.REPORT_SUFFIX}"):
            self.links.finish()

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
        """Starts a later receive now, so that its data arrives while this rank computes."""
        posted = self._start_receive(op, mb, chunk, peer)
        if posted is not None:
            self.posted[(op, mb, chunk)] = posted

    def _start_receive(self, op, mb, chunk, peer):
        """The receive of an activation (a subclass adds others); None when it is left to its
        instruction: the boundary's layout is not known yet."""
        return self.links.post("activation", self.module.global_stage(chunk), mb, self._peer(peer))


_COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


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
