"""Activations and gradients between pipeline stages over the world communicator's c10d send/recv,
with each boundary's dtypes and shapes agreed at the first micro-batch and checked after, or sent
with every activation under dynamic_shape (see StageLinks)."""

import torch

SENDS_IN_FLIGHT = 2

# dtype <-> the code sent in a layout message
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


def _layout(tensors):
    return [(t.dtype, tuple(t.shape)) for t in tensors]


def _show(layout):
    return "(" + ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, s in layout) + ")"


def as_tuple(value, what):
    """A stage's output as a tuple of tensors (what crosses a boundary)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for i, t in enumerate(items):
        if not torch.is_tensor(t):
            raise TypeError(f"{what}: element {i} is {type(t).__name__}; only tensors (or tuples "
                            "of tensors) cross pipeline stage boundaries")
    return tuple(items)


class _Posted:
    """A receive in flight: its buffers and their transfers."""

    def __init__(self, tensors, works):
        self.tensors, self.works = tensors, works

    def wait(self):
        for work in self.works:
            work.wait()
        return self.tensors


class StageLinks:
    """The sender describes what crosses each boundary (a tensor or a tuple) once, at the first
    micro-batch; both sides keep that layout, and a later micro-batch whose tensors differ is an
    error naming the stage, the micro-batch and both layouts instead of a receive of the wrong size.
    With dynamic_shape (DeepSpeed's PipelineModule argument) the sender describes every activation
    instead, so the shapes may change from micro-batch to micro-batch (variable sequence lengths
    or batch sizes); nothing is agreed or checked, and a receive waits for its layout first.

    Sends return at once (the backend's thread moves the data while the stage computes); a rank
    keeps at most SENDS_IN_FLIGHT messages in flight, waiting for older ones as it sends (a checked
    schedule is deadlock-free with sends that block until received, so waiting for a send at any
    later point cannot deadlock either, and it ends no later than that send would have).

    Receives are started (post, start_receive) and waited for apart: the runner waits where the
    data is used (pipe/list_run.py). Matching: Gloo matches transfers by tag, so receives can be
    posted ahead of their instruction, and their data arrives during the computation before it.
    NCCL ignores tags and matches each direction between two ranks in issue order, where a
    receive moved ahead could meet the wrong send: with matches_in_order (set on NCCL) every
    transfer gets one tag and receives start at their instruction. The setting can be turned on
    over Gloo, which then matches in issue order too (tests/python/test_pipe_parity.py runs
    NCCL's order that way)."""

    def __init__(self, comm, device, dynamic_shape=False):
        self._comm = comm
        self._device = device
        self.dynamic_shape = dynamic_shape  # PipelineModule's (see the class's docstring)
        self._agreed = {}   # (kind, global stage it enters) -> (layout, micro-batch it was agreed at)
        self._sending = []  # [(works, tensors)] per message in flight, oldest first
        self._backend = comm.backend
        self.matches_in_order = comm.backend == "nccl"  # see the class's docstring

    @property
    def posts_ahead(self):
        """Whether receives may be started ahead of their instruction (matched by tag)."""
        return not self.matches_in_order

    def _tag(self, kind, micro_batch, stage):
        if self.matches_in_order:
            return 0
        # Gloo matches by tag: one per tensor kind, micro-batch and boundary.
        return 1 + 4 * (micro_batch * 4096 + stage) + {"activation": 0, "gradient": 1, "layout": 2}[kind]

    def send(self, tensors, kind, stage, micro_batch, peer):
        """tensors: the activation entering global stage `stage`, or the gradient leaving it
        (sent back to stage - 1), to global rank `peer`. Returns once the transfers are issued."""
        layout = _layout(tensors)
        works, kept = [], []  # the layout's message first, where one goes with it
        if not self.dynamic_shape:
            self._agree(layout, kind, stage, micro_batch, peer, works, kept)
        elif kind == "activation":  # a gradient's layout is its outputs', which the receiver holds
            self._send_layout(layout, stage, micro_batch, peer, works, kept)
        what = f"{kind} of micro-batch {micro_batch} for stage {stage}"
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()  # kept, unchanged, until its send is waited for
            works.append(self._comm.isend(t, peer, self._tag(kind, micro_batch, stage), f"{what} [{i}]"))
            kept.append(t)
        self._sending.append((works, kept))
        # A message held longer would keep its activation or gradient alive past its use.
        while len(self._sending) > SENDS_IN_FLIGHT:
            for work in self._sending.pop(0)[0]:
                work.wait()

    def _agree(self, layout, kind, stage, micro_batch, peer, works, kept):
        """The boundary's layout from its first micro-batch on (sent to the receiver once, for an
        activation); a later one that differs is an error naming both."""
        key = (kind, stage)
        if key not in self._agreed:
            if kind == "activation":
                self._send_layout(layout, stage, micro_batch, peer, works, kept)
            self._agreed[key] = (layout, micro_batch)
        agreed, first = self._agreed[key]
        if layout != agreed:
            side = f"output of stage {stage - 1}" if kind == "activation" else f"input gradient of stage {stage}"
            raise ValueError(f"pipeline: the {side} for micro-batch {micro_batch} is {_show(layout)}, "
                             f"but micro-batch {first} agreed {_show(agreed)}; the tensors crossing a "
                             "stage boundary keep their dtypes and shapes for the whole run unless the "
                             "PipelineModule has dynamic_shape=True (or pad variable-length batches to one "
                             "length, or call reset_activation_shape() on every rank between steps)")

    def forget_layouts(self):
        """The boundary layouts are agreed again at the next micro-batch (every rank calls it
        between steps: DeepSpeed's reset_activation_shape)."""
        self._agreed = {}

    @property
    def sends_in_flight(self):
        """Messages sent and not yet waited for."""
        return len(self._sending)

    def finish(self):
        """Waits for every send in flight (the end of a step: the peers have received it all)."""
        sending, self._sending = self._sending, []
        for works, _ in sending:
            for work in works:
                work.wait()

    def post(self, kind, stage, micro_batch, peer, like=None, layout=None):
        """Starts receiving the activation entering `stage`, or the gradient for the tensors
        `like` (this stage's outputs); None when the activation's layout is not known yet (its
        first micro-batch receives it at the instruction, and with dynamic_shape every one)."""
        if layout is None:
            if kind == "gradient":
                layout = _layout(like)
            elif self.dynamic_shape or (kind, stage) not in self._agreed:
                return None
            else:
                layout = self._agreed[(kind, stage)][0]
        what = f"{kind} of micro-batch {micro_batch} for stage {stage}"
        tensors, works = [], []
        for i, (dtype, shape) in enumerate(layout):
            # A storage of its own per tensor: TrainStep.forward frees a received activation's
            # once it has copied it.
            t = torch.empty(shape, dtype=dtype, device=self._device)
            works.append(self._comm.irecv(t, peer, self._tag(kind, micro_batch, stage), f"{what} [{i}]"))
            tensors.append(t)
        return _Posted(tuple(tensors), works)

    def start_receive(self, kind, stage, micro_batch, peer, like=None):
        """post, for a receive whose layout may not be known yet: the activation's layout is
        received first where it travels with the data (a boundary's first micro-batch, and every
        one with dynamic_shape), waiting for it. Returns the receive in flight; wait() gives its
        tensors."""
        key = (kind, stage)
        layout = None
        if kind == "activation" and self.dynamic_shape:
            layout = self._receive_layout(stage, micro_batch, peer)
        elif kind == "activation" and key not in self._agreed:
            self._agreed[key] = (self._receive_layout(stage, micro_batch, peer), micro_batch)
        return self.post(kind, stage, micro_batch, peer, like, layout)

    def _send_layout(self, layout, stage, micro_batch, peer, works, kept):
        """Starts sending the layout (its length, then its codes), adding the transfers and their
        tensors to the message's: it is waited for with the message, so a sender does not stop
        until its peer reaches the receive."""
        codes = [len(layout)]
        for dtype, shape in layout:
            if dtype not in _DTYPES:
                raise TypeError(f"pipeline: stage {stage - 1} outputs a {dtype} tensor; boundary "
                                f"tensors may be {', '.join(str(d) for d in _DTYPES)}")
            if dtype == torch.int16 and self._backend == "nccl":  # NCCL has no 16-bit integer type
                raise TypeError(f"pipeline: stage {stage - 1} outputs an int16 tensor, which NCCL cannot "
                                "send; make it int32 (or int8) at the stage boundary")
            codes += [_DTYPES.index(dtype), len(shape), *shape]
        message = torch.tensor(codes, dtype=torch.int64, device=self._device)
        size = torch.tensor([message.numel()], dtype=torch.int64, device=self._device)
        tag = self._tag("layout", micro_batch, stage)
        works.append(self._comm.isend(size, peer, tag, f"layout size for stage {stage}"))
        works.append(self._comm.isend(message, peer, tag, f"layout of the tensors entering stage {stage}"))
        kept += [size, message]

    def _receive_layout(self, stage, micro_batch, peer):
        tag = self._tag("layout", micro_batch, stage)
        size = torch.empty(1, dtype=torch.int64, device=self._device)
        self._comm.recv(size, peer, tag, f"layout size for stage {stage}")
        message = torch.empty(int(size.item()), dtype=torch.int64, device=self._device)
        self._comm.recv(message, peer, tag, f"layout of the tensors entering stage {stage}")
        codes = message.tolist()
        layout, i = [], 1
        for _ in range(codes[0]):
            dtype, ndim = _DTYPES[codes[i]], codes[i + 1]
            layout.append((dtype, tuple(codes[i + 2:i + 2 + ndim])))
            i += 2 + ndim
        return layout
