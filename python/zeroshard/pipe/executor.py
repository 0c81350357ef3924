"""Runs one rank's instruction list for one training step (the list comes from C++, built and
checked there: pipeline/schedule.h). Each instruction is one method here (what every list's run
shares is in list_run.py, the stage's received input too); the state between them is per
(micro-batch, model chunk): its output, and the gradients that arrive for the output or leave for
the input. An instruction of this rank's own that raises is reported through the world
communicator before it propagates, so every rank's error names the stage and the micro-batch (see
PipelineEngine._stage_failure_reported)."""
import torch

from zeroshard.pipe.list_run import ListRun
from zeroshard.pipe.p2p import as_tuple
from zeroshard.pipe.weight_pass import WeightPass, backward_input


def _floating(tensors):
    return [t for t in tensors if t.is_floating_point()]


def _copy_and_free(received):
    """A copy of a received tensor, whose own storage is then freed: from here on only its shape
    and .grad are read. StageLinks gives each received tensor a storage of its own; one shared
    (a view) is left alone."""
    copy = received.clone()
    if received._base is None and received.untyped_storage().nbytes() == received.nbytes:
        received.untyped_storage().resize_(0)
    return copy


class TrainStep(ListRun):
    """Runs one rank's list for one training step: forwards, backwards (whole, or zero bubble's
    split), the transfers between stages, and the tie and data-parallel reductions."""
    OPS = ("load_micro_batch", "forward", "backward", "backward_input", "backward_weight", "send_activation",
           "receive_activation", "send_gradient", "receive_gradient", "reduce_tied", "reduce_data_parallel")
    USES = {**ListRun.USES, "backward": "receive_gradient", "backward_input": "receive_gradient"}
    AFTER_THE_LIST = ("optimizer_step",)  # the engine steps after the list, with the losses in hand
    RECORDS = True

    def __init__(self, engine, data_iter):
        super().__init__(engine, data_iter)
        self.core = engine._core
        self.gas = engine._gas
        self.outputs = {}     # (mb, chunk) -> tuple of outputs; (scaled loss,) on the last stage
        self.out_grads = {}   # (mb, chunk) -> gradients received for the floating outputs
        self.in_grads = {}    # (mb, chunk) -> gradients of the floating inputs, to send
        self.weight_passes = {}  # (mb, chunk) -> zero bubble's W, left by its B
        self.losses = []

    # ----- compute -----
    def forward(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("forward", mb, chunk):
            # A copy of each received tensor that takes a gradient, as DeepSpeed's engine makes:
            # the received ones are autograd leaves, which a stage's first layer may not change in
            # place (AlexNet's ReLU(inplace=True) opens a stage). The received tensor's memory is
            # freed once copied, so the stage holds one copy, not two.
            x = self._stage_input(mb, chunk, lambda: tuple(_copy_and_free(t) if t.requires_grad else t
                                                           for t in self.inputs[(mb, chunk)]))
            out = self.module(x, chunk=chunk)
            if stage == self.last_stage:
                loss = self.engine._loss_of(out, self._take(mb, 1), mb)
                self.losses.append(loss.detach())
                # The mean over the step's micro-batches, times the fp16 loss scale.
                self.outputs[(mb, chunk)] = (loss * (self.core.state.loss_scale / self.gas),)
            else:
                self.outputs[(mb, chunk)] = as_tuple(out, f"stage {stage} output")

    def _roots(self, mb, chunk):
        """The tensors backward starts from and the gradients they start with."""
        outs = self.outputs[(mb, chunk)]
        if self.module.global_stage(chunk) == self.last_stage:
            return list(outs), [None]
        grads = self.out_grads.pop((mb, chunk))
        pairs = [(o, g) for o, g in zip(_floating(outs), grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, mb, chunk):
        """Gradients of the floating inputs, from backward (zeros where the input did not reach
        the output)."""
        if self.module.global_stage(chunk) == 0:
            return
        floats = _floating(self.inputs[(mb, chunk)])
        self.in_grads[(mb, chunk)] = tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in floats)

    def backward(self, mb, chunk, peer):
        with self._reported("backward", mb, chunk):
            roots, grads = self._roots(mb, chunk)
            if roots:
                self._accumulating(lambda: torch.autograd.backward(roots, grads if grads[0] is not None else None))
            self._input_grads(mb, chunk)
            self.outputs.pop((mb, chunk))
            self.inputs.pop((mb, chunk), None)

    def backward_input(self, mb, chunk, peer):
        """Zero bubble's B: the input's gradient now; what the weights need is kept for W
        (pipe/weight_pass.py)."""
        with self._reported("backward_input", mb, chunk):
            roots, grads = self._roots(mb, chunk)
            self.outputs.pop((mb, chunk))
            first = self.module.global_stage(chunk) == 0
            floats = [] if first else [x for x in _floating(self.inputs[(mb, chunk)]) if x.requires_grad]
            self.weight_passes[(mb, chunk)] = (self._accumulating(lambda: backward_input(roots, grads, floats))
                                               if roots else WeightPass([]))
            self._input_grads(mb, chunk)  # zeros where nothing reached an input

    def backward_weight(self, mb, chunk, peer):
        """Zero bubble's W: the weights' gradients, accumulated where the engine's hooks see them."""
        with self._reported("backward_weight", mb, chunk):
            self._accumulating(self.weight_passes.pop((mb, chunk)).run)
            self.inputs.pop((mb, chunk), None)

    def _accumulating(self, backward):
        """Runs backward() as one of the micro-batch's non-boundary backwards (the gradients
        accumulate; reduce_data_parallel reduces them at the end of the step)."""
        self.core.before_backward(False)
        try:
            result = backward()
        except BaseException as error:
            self.engine._clean_up_after(error, self.core.abort_backward)
            raise
        self.core.after_backward(False)
        return result

    # ----- transfers -----
    def send_activation(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("send_activation", mb, chunk):
            self.links.send(self.outputs[(mb, chunk)], "activation", stage + 1, mb, self._peer(peer))

    def send_gradient(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("send_gradient", mb, chunk):
            self.links.send(self.in_grads.pop((mb, chunk)), "gradient", stage, mb, self._peer(peer))

    def receive_gradient(self, mb, chunk, peer):
        self._receive("receive_gradient", mb, chunk, peer)

    def _receive_of(self, op, mb, chunk):
        """A gradient's receive too: for this chunk's floating outputs, once its forward has made
        them (None before)."""
        if op == "receive_activation":
            return super()._receive_of(op, mb, chunk)
        if (mb, chunk) not in self.outputs:
            return None
        return "gradient", self.module.global_stage(chunk) + 1, _floating(self.outputs[(mb, chunk)])

    def _arrived(self, op, mb, chunk, tensors):
        """A received activation becomes the stage's input, its floating tensors leaves that
        collect their gradients (kept until the backward); a gradient waits for the backward."""
        if op == "receive_gradient":
            self.out_grads[(mb, chunk)] = tensors
            return
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_()
        self.inputs[(mb, chunk)] = tensors

    # ----- reductions -----
    def reduce_tied(self, mb, chunk, peer):
        # Sends still in flight end first: on NCCL, point-to-point work pending on one
        # communicator while another's collective starts can deadlock.
        self.links.finish()
        with self.engine._named_by_world("reduce_tied"):
            self._reduce_tied()

    def _reduce_tied(self):
        for key, stages, comm in self.module.tied_groups():
            for attr, weight in self.module.trained_tied_weights(key):
                if weight.grad is None:
                    # No use of it reached this copy: zeros go into the engine's gradient view
                    # (a fresh tensor would be summed, then dropped by the data-parallel step).
                    self.core.grad_ready(weight._zeroshard_index, torch.zeros_like(weight))
                    weight.grad = self.engine._grad_views[weight._zeroshard_index]
                comm.all_reduce(weight.grad, f"tied gradient {key}.{attr} over stages {stages}")

    def reduce_data_parallel(self, mb, chunk, peer):
        self.links.finish()  # as in reduce_tied
        # An empty boundary backward: the reducer reduces every bucket (stages 0 and 1).
        with self.engine._named_by_world("reduce_data_parallel"):
            self.core.before_backward(True)
            self.core.after_backward(True)
