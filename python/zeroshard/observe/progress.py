"""The rank-0 progress line every steps_per_print steps: the loss (mean over ranks and micro-steps
since the last line), lr, loss scale, gradient norm, samples/s, the model TFLOPS this rank
achieved (observe/flops.py counts them), peak device and host memory, the per-phase times with
wall_clock_breakdown, and the model-state bytes the runtime accounts. memory_breakdown adds a
memory line after every step."""
import resource
import time

import torch

from zeroshard import _C
from zeroshard.log import log_rank0


def _peak_device_text(device, memory):
    if device.type == "cuda":
        return f"peak device {_C.format_bytes(torch.cuda.max_memory_allocated(device))}"
    # No torch figure for CPU tensors: the runtime's own peak of the model state it holds.
    return f"peak model state {_C.format_bytes(memory.peak_total_bytes)}"


def _figure(value):
    """Three decimals, or three significant digits below 1 (a small model's TFLOPS is not 0.000)."""
    return f"{value:.3f}" if value >= 1 else f"{value:.3g}"


def _peak_host_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class ProgressLine:
    def __init__(self, every, rank, world_size, device, batch_size):
        self._every, self._rank, self._world = every, rank, world_size
        self._device, self._batch = device, batch_size
        self._loss_sum, self._loss_count = 0.0, 0
        self._t0, self._step0 = time.perf_counter(), 0

    def add_loss(self, loss):
        # Summed on the loss's device; read only when a line is printed.
        self._loss_sum = self._loss_sum + loss.detach().float()
        self._loss_count += 1

    def maybe_print(self, engine, flops_per_step, phases):
        steps = engine.global_steps
        if not self._every or steps % self._every != 0:
            return
        # Mean loss over ranks and micro-steps since the last line (one small all-reduce, on a
        # tensor made in C++: see Comm.all_reduce_values).
        total, count = float(self._loss_sum), float(self._loss_count)
        if self._world > 1:
            total, count = engine._comm.all_reduce_values([total, count], str(self._device), "progress line")
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        rate = (steps - self._step0) * self._batch / elapsed
        tflops = "" if flops_per_step is None else f" TFLOPS {_figure(flops_per_step * (steps - self._step0) / elapsed / 1e12)}"
        self._t0, self._step0 = now, steps
        self._loss_sum, self._loss_count = 0.0, 0
        last = engine._last
        norm = last.grad_norm if last is not None else float("nan")
        memory = engine._core.memory
        times = ""
        if phases:
            times = " | ms: " + " ".join(f"{name} {ms:.1f}" for name, ms in phases.items())
        log_rank0(f"step {steps} loss {total / max(count, 1.0):.4f} lr {engine.get_lr()[0]:.3e} "
                  f"loss_scale {engine._core.state.loss_scale:g} grad_norm {norm:.3f} "
                  f"samples/s {rate:.1f}{tflops} | {_peak_device_text(self._device, memory)}, "
                  f"peak host {_C.format_bytes(_peak_host_bytes())}{times} | model state per rank: "
                  f"{memory.summary()}", self._rank)

    def memory_breakdown(self, engine):
        """DeepSpeed's memory_breakdown: the memory after each step."""
        memory = engine._core.memory
        device = ""
        if self._device.type == "cuda":
            device = (f" | device allocated {_C.format_bytes(torch.cuda.memory_allocated(self._device))} "
                      f"(max {_C.format_bytes(torch.cuda.max_memory_allocated(self._device))})")
        log_rank0(f"memory after step {engine.global_steps}: model state {memory.summary()}{device} | "
                  f"host peak {_C.format_bytes(_peak_host_bytes())}", self._rank)
