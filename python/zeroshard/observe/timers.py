"""DeepSpeed's wall_clock_breakdown: each step's forward, backward (its compute and the gradient
reduction it waited for) and optimizer step, in ms, summed over the step's micro-steps; with
offload, the step's transfer and host-update phases from the C++ sub-group runner.

backward_allreduce is what DeepSpeed's name promises where it matters: the time backward spent
blocked on its gradient collectives (the part overlap did not hide, counted in C++ by each
collective's wait); backward_inner is the rest. On CUDA each phase ends with a device sync, as
DeepSpeed's timers do, so the times are the device's."""
import time

import torch

from zeroshard import _C

PHASES = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


class PhaseTimers:
    def __init__(self, device, offloads):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self._offloads = offloads  # the optimizer's step runs in host memory (offload_optimizer)
        self._window = dict.fromkeys(PHASES, 0.0)
        self._last = {}
        self._open = {}  # phase -> (start, blocked ns at start)
        _C.trace.set_timing(True)

    def start(self, phase):
        if self._sync is not None:
            self._sync()
        self._open[phase] = (time.perf_counter(), _C.trace.blocked_ns())

    def stop(self, phase):
        if self._sync is not None:
            self._sync()
        started, blocked = self._open.pop(phase)
        ms = (time.perf_counter() - started) * 1e3
        self._window[phase] += ms
        if phase == "backward":
            waited = (_C.trace.blocked_ns() - blocked) / 1e6
            self._window["backward_allreduce"] += waited
            self._window["backward_inner"] += ms - waited

    def add(self, phase, ms):
        """A measured piece of a phase (the pipeline's instructions): "forward", "backward" (its
        compute) or "backward_allreduce" (its reductions); both backward kinds add to backward."""
        if phase == "forward":
            self._window["forward"] += ms
            return
        self._window["backward"] += ms
        self._window["backward_allreduce" if phase == "backward_allreduce" else "backward_inner"] += ms

    def end_window(self, core):
        """At the step: the window's phases (ms), offload's phases added; a new window begins."""
        times = dict(self._window)
        if self._offloads:
            last = core.last_step_times()
            times["transfer"] = last["transfer_ms"]
            times["host_step"] = last["host_step_ms"]
            if last["nvme_wait_ms"]:
                times["nvme_wait"] = last["nvme_wait_ms"]
        self._window = dict.fromkeys(PHASES, 0.0)
        self._last = times
        return times

    @property
    def last(self):
        """The last finished window's phases (ms); empty before the first step."""
        return dict(self._last)

    def close(self):
        _C.trace.set_timing(False)
