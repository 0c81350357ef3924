"""What a run says about itself: the progress line, DeepSpeed's wall_clock_breakdown,
memory_breakdown, monitors (tensorboard, csv_monitor, wandb, comet), flops_profiler and
comms_logger, and zeroshard's per-rank trace. The engine calls one Observer at each phase of a
micro-step and at the step; each part lives in its own file here and costs nothing when off."""
import time

from zeroshard import _C
from zeroshard.observe import comms
from zeroshard.observe import trace as trace_settings
from zeroshard.observe.flops import FlopsProfiler
from zeroshard.observe.monitors import Monitors
from zeroshard.observe.progress import ProgressLine
from zeroshard.observe.timers import PhaseTimers
from zeroshard.observe.trace import Trace


class Observer:
    def __init__(self, engine):
        config, settings = engine.config, engine._settings
        rank = engine.global_rank
        self._engine = engine
        self.progress = ProgressLine(settings["steps_per_print"], rank, engine.world_size, engine.device,
                                     engine._train_batch_size)
        self.flops = FlopsProfiler(config["flops_profiler"], engine.module, rank, engine.world_size,
                                   engine.dp_world_size, engine._micro_batch_size, engine._gas)
        # DeepSpeed times the phases for wall_clock_breakdown and for the flops profiler's monitors.
        self._breakdown = bool(config["wall_clock_breakdown"])
        self.timers = (PhaseTimers(engine.device, settings["offload_optimizer"] != "none")
                       if self._breakdown or self.flops.enabled else None)
        self.monitors = Monitors(config, rank)
        comms.configure(config.get("comms_logger"), rank)
        block = trace_settings.settings(config)
        self.trace = (Trace(block, engine.module, engine._core.memory, engine._all_ranks_comm, rank, engine.world_size)
                      if block.get("enabled") else None)
        self._memory_breakdown = bool(config["memory_breakdown"])
        self._in_step = False     # a micro-step of the current step has begun
        self._window_loss = None  # rank 0's loss summed over the step's micro-steps (monitors)
        self._loss_event = None   # its monitor event, written once the step's window has closed
        self._step_started = None
        self._started_ns = {}     # phase ("forward", "backward", "step", "window") -> its start

    def _phase(self, phase, begin):
        """Marks a phase's start, or records its span in the trace at its end."""
        if self.trace is None:
            return
        # Resident memory (and torch's allocated on CUDA) at each phase edge, sampled inside the
        # phase: the phases still add up to the step.
        if begin:
            self._started_ns[phase] = _C.trace.now_ns()
            self.trace.sample_process()
            return
        self.trace.sample_process()
        now = _C.trace.now_ns()
        if phase in self._started_ns:
            name = f"step {self._engine.global_steps}" if phase == "window" else phase
            self.trace.record("step" if phase == "window" else "phase", name, self._started_ns.pop(phase), now)

    # ----- one micro-step -----
    def _begin_step_if_new(self):
        first = not self._in_step
        if first:
            self._in_step = True
            if self.trace is not None:
                self.trace.step_begins(self._engine.global_steps + 1)
            self._phase("window", True)
        return first

    # The trace's phase spans enclose the observer's own bookkeeping: a step's phases add up to it.
    def forward_begin(self):
        first = self._begin_step_if_new()
        self._phase("forward", True)
        self.flops.begin("forward", self._engine.global_steps, first)
        if self.timers is not None:
            self.timers.start("forward")

    def forward_end(self):
        if self.timers is not None:
            self.timers.stop("forward")
        self.flops.end("forward")
        self._phase("forward", False)

    def backward_begin(self):
        self._begin_step_if_new()
        self._phase("backward", True)
        self.flops.begin("backward", self._engine.global_steps, False)
        if self.timers is not None:
            self.timers.start("backward")

    def backward_end(self, loss, scaled_loss, boundary):
        """loss: as the script computed it; scaled_loss: divided by the accumulation steps, whose
        sum over the step is the mean DeepSpeed's monitors report. None for both when backward
        raised: only the phase ends."""
        if self.timers is not None:
            self.timers.stop("backward")
        self.flops.end("backward")
        if loss is not None:
            self.progress.add_loss(loss)
            if self.monitors.enabled:
                part = scaled_loss.detach().float()
                self._window_loss = part if self._window_loss is None else self._window_loss + part
                if boundary:
                    self._loss_event = ("Train/Samples/train_loss", self._window_loss, self._engine.global_samples)
                    self._window_loss = None
        self._phase("backward", False)

    def step_begin(self):
        self._phase("step", True)
        self._step_started = time.perf_counter()
        if self.timers is not None:
            self.timers.start("step")

    def step_end(self, boundary):
        """After engine.step(): every micro-step's call counts in the step phase (as DeepSpeed's
        step_microstep); at the accumulation boundary (the optimizer stepped or skipped) the
        step's reports follow."""
        engine = self._engine
        step_seconds = time.perf_counter() - (self._step_started or time.perf_counter())
        if self.timers is not None:
            self.timers.stop("step")
        self._phase("step", False)
        if not boundary:
            return
        self._phase("window", False)
        phases = None
        if self.timers is not None:
            phases = self.timers.end_window(engine._core)
        self._in_step = False
        if self.monitors.enabled:
            events = [("Train/Samples/lr", engine.get_lr()[0], engine.global_samples)]
            if self._loss_event is not None:
                tag, loss, samples = self._loss_event
                events.insert(0, (tag, float(loss), engine.global_samples if samples is None else samples))
                self._loss_event = None
            if engine.fp16_enabled():
                events.append(("Train/Samples/loss_scale", engine.get_loss_scale(), engine.global_samples))
            if phases is not None:
                events += [(f"Train/Samples/elapsed_time_ms_{name}", ms, engine.global_samples)
                           for name, ms in phases.items()]
            self.monitors.write(events)
        self.flops.after_step(step_seconds, engine.global_steps)
        self.progress.maybe_print(engine, self.flops.flops_per_step, phases if self._breakdown else None)
        if self._memory_breakdown:
            self.progress.memory_breakdown(engine)
        if self.trace is not None:
            self.trace.sample_process()
            self.trace.step_ends(engine.global_steps)

    # ----- pipelines: instructions instead of forward / backward calls -----
    def pipeline_step_begin(self):
        self._begin_step_if_new()

    @property
    def wants_instructions(self):
        """Whether the pipeline's executor should time each instruction for instruction()."""
        return self.trace is not None or self.timers is not None

    def pipeline_loss(self, loss):
        """train_batch's loss (the mean over the step's micro-batches and data-parallel ranks),
        before the step; its monitor event goes out after the step, at the samples seen then,
        as DeepSpeed's pipeline engine writes it."""
        self.progress.add_loss(loss)
        if self.monitors.enabled:
            self._loss_event = ("Train/Samples/train_loss", loss, None)

    def instruction(self, op, micro_batch, chunk, start_ns, end_ns):
        if self.trace is not None:
            self.trace.record("pipeline", f"{op} mb {micro_batch}" + (f" chunk {chunk}" if chunk else ""),
                              start_ns, end_ns, f'"micro_batch": {micro_batch}, "chunk": {chunk}')
        if self.timers is not None:
            phase = {"forward": "forward", "backward": "backward", "backward_input": "backward",
                     "backward_weight": "backward", "reduce_tied": "backward_allreduce",
                     "reduce_data_parallel": "backward_allreduce"}.get(op)
            if phase is not None:
                self.timers.add(phase, (end_ns - start_ns) / 1e6)

    def close(self):
        if self.trace is not None:
            self.trace.close()
        self.monitors.close()
        if self.timers is not None:
            self.timers.close()
