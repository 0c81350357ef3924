"""Runs one rank's instruction list for one training step (the list comes from C++, built and
checked there: pipeline/schedule.h). Each instruction is one method here; the state between
them is per (micro-batch, model chunk): the stage's input, its output, and the gradients that
arrive for the output or leave for the input. A compute instruction that raises is reported
through the world communicator before it propagates, so every rank's error names the stage and
the micro-batch (see _reported)."""
import contextlib
import time

import torch

from zeroshard import _C
from zeroshard.pipe.p2p import as_tuple


def _floating(tensors):
    return [t for t in tensors if t.is_floating_point()]


class TrainStep:
    def __init__(self, engine, data_iter):
        self.engine = engine
        self.module = engine.module
        self.core = engine._core
        self.links = engine._links
        self.data_iter = data_iter
        self.p = self.module.num_stages
        self.last_stage = self.module.num_global_stages - 1  # the global stage that computes the loss
        self.gas = engine._gas
        self.batches = {}
        self.inputs = {}      # (mb, chunk) -> tuple: the stage's input (received tensors are leaves)
        self.outputs = {}     # (mb, chunk) -> tuple of outputs; (scaled loss,) on the last stage
        self.out_grads = {}   # (mb, chunk) -> gradients received for the floating outputs
        self.in_grads = {}    # (mb, chunk) -> gradients of the floating inputs, to send
        self.losses = []

    # ----- running -----
    def run(self, instructions):
        handlers = {
            "load_micro_batch": self.load_micro_batch, "forward": self.forward,
            "backward": self.backward, "backward_input": self.backward_input,
            "backward_weight": self.backward_weight, "send_activation": self.send_activation,
            "receive_activation": self.receive_activation, "send_gradient": self.send_gradient,
            "receive_gradient": self.receive_gradient, "reduce_tied": self.reduce_tied,
            "reduce_data_parallel": self.reduce_data_parallel,
        }
        timeline = self.engine._timeline  # a list when the benchmark records, else None
        for op, mb, chunk, peer in instructions:
            if op == "optimizer_step":
                continue  # the engine steps after the list, with the losses in hand
            if timeline is None:
                handlers[op](mb, chunk, peer)
                continue
            start = time.perf_counter()
            handlers[op](mb, chunk, peer)
            timeline.append((op, mb, chunk, start, time.perf_counter()))

    @contextlib.contextmanager
    def _reported(self, op, mb, chunk):
        stage = self.module.global_stage(chunk)
        try:
            yield
        except _C.CommError:
            raise  # a failed send or receive names every rank already
        except BaseException as error:
            self.engine._report_stage_failure(error, f"pipeline stage {stage} {op} of micro-batch {mb}")
            raise

    def _peer(self, peer):
        return self.engine._grid.stage_to_global(peer)

    # ----- data -----
    def load_micro_batch(self, mb, chunk, peer):
        with self._reported("load_micro_batch", mb, chunk):
            self.batches[mb] = self.engine._next_micro_batch(self.data_iter, mb)

    # ----- compute -----
    def forward(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("forward", mb, chunk):
            if stage == 0:
                x = self.batches[mb][0]
            else:
                x = self.inputs[(mb, chunk)]
                x = x[0] if len(x) == 1 else x
            out = self.module(x, chunk=chunk)
            if stage == self.last_stage:
                loss = self.engine._loss_of(out, self.batches[mb][1], mb)
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

    def _input_grads(self, mb, chunk, grads=None):
        """Gradients of the floating inputs (zeros where the input did not reach the output)."""
        if self.module.global_stage(chunk) == 0:
            return
        floats = _floating(self.inputs[(mb, chunk)])
        if grads is None:
            grads = [x.grad for x in floats]
        self.in_grads[(mb, chunk)] = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(floats, grads))

    def backward(self, mb, chunk, peer):
        with self._reported("backward", mb, chunk):
            roots, grads = self._roots(mb, chunk)
            self._autograd(roots, grads)
            self._input_grads(mb, chunk)
            self.outputs.pop((mb, chunk))
            self.inputs.pop((mb, chunk), None)

    def backward_input(self, mb, chunk, peer):
        """Zero bubble's B: only the input's gradient (the graph is kept for W)."""
        with self._reported("backward_input", mb, chunk):
            roots, grads = self._roots(mb, chunk)
            self.outputs[(mb, chunk)] = (roots, grads)  # W starts from the same roots
            if self.module.global_stage(chunk) == 0:
                return
            floats = [x for x in _floating(self.inputs[(mb, chunk)]) if x.requires_grad]
            if not roots:  # nothing reaches the outputs: the previous stage gets zeros, as in backward
                self._input_grads(mb, chunk, [None] * len(floats))
                return
            got = torch.autograd.grad(roots, floats, grads, retain_graph=True, allow_unused=True)
            self._input_grads(mb, chunk, got)

    def backward_weight(self, mb, chunk, peer):
        """Zero bubble's W: the weights' gradients, accumulated where the engine's hooks see them."""
        with self._reported("backward_weight", mb, chunk):
            roots, grads = self.outputs.pop((mb, chunk))
            params = self.module.chunk_parameters(chunk)
            self._autograd(roots, grads, inputs=params or None)
            self.inputs.pop((mb, chunk), None)

    def _autograd(self, roots, grads, inputs=None):
        if not roots:
            return
        self.core.before_backward(False)  # every micro-batch accumulates; reduce_data_parallel reduces
        try:
            torch.autograd.backward(roots, [g for g in grads] if grads[0] is not None else None, inputs=inputs)
        except BaseException as error:
            self.engine._clean_up_after(error, self.core.abort_backward)
            raise
        self.core.after_backward(False)

    # ----- transfers -----
    def send_activation(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("send_activation", mb, chunk):
            self.links.send(self.outputs[(mb, chunk)], "activation", stage + 1, mb, self._peer(peer))

    def receive_activation(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        tensors = self.links.receive("activation", stage, mb, self._peer(peer))
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_()
        self.inputs[(mb, chunk)] = tensors

    def send_gradient(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("send_gradient", mb, chunk):
            self.links.send(self.in_grads.pop((mb, chunk)), "gradient", stage, mb, self._peer(peer))

    def receive_gradient(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        like = _floating(self.outputs[(mb, chunk)])
        self.out_grads[(mb, chunk)] = self.links.receive("gradient", stage + 1, mb, self._peer(peer), like=like)

    # ----- reductions -----
    def reduce_tied(self, mb, chunk, peer):
        for key, stages, comm in self.module.tied_groups():
            for attr, weight in zip(self.module.tied_weight_attrs[key], self.module.tied_weights(key)):
                if weight.grad is None:
                    # No use of it reached this copy: zeros go into the engine's gradient view
                    # (a fresh tensor would be summed, then dropped by the data-parallel step).
                    self.core.grad_ready(weight._zeroshard_index, torch.zeros_like(weight))
                    weight.grad = self.engine._grad_views[weight._zeroshard_index]
                comm.all_reduce(weight.grad, f"tied gradient {key}.{attr} over stages {stages}")

    def reduce_data_parallel(self, mb, chunk, peer):
        # An empty boundary backward: the reducer reduces every bucket (stages 0 and 1).
        self.core.before_backward(True)
        self.core.after_backward(True)
