"""DeepSpeed's PipelineEngine: the ZeRO engine (stage 0 or 1 across the data axis) over one
pipeline stage's layers, driven by train_batch/eval_batch instead of forward/backward/step. Each
step runs the rank's instruction list from C++ (_C.pipeline.build: gpipe, 1f1b,
interleaved_1f1b or zero_bubble, checked deadlock-free before it runs) through TrainStep."""
import contextlib

import torch

from zeroshard import _C
from zeroshard.comm import new_comm
from zeroshard.dataloader import RepeatingLoader
from zeroshard.engine import ZeroShardEngine
from zeroshard.log import log_rank0, note_rank0
from zeroshard.optimizer import group_fingerprint
from zeroshard.pipe import PipelineError
from zeroshard.pipe.executor import TrainStep
from zeroshard.pipe.p2p import StageLinks
from zeroshard.pipe.schedule import build_schedule, pipeline_accepts

_CAUSE_CHARS = 200  # of a failing stage's first error line, in the report every rank reads

_TRAIN_ONLY = ("Only train_batch() and eval_batch() are accessible in pipeline mode: a pipeline "
               "runs forward, backward and step for all micro-batches of a batch together")


class PipelineEngine(ZeroShardEngine):
    # initialize(training_data=...) is read in order, each data-parallel rank its part, as
    # DeepSpeed's PipelineEngine reads it (a DistributedSampler without shuffling).
    _shuffles_training_data = False

    def __init__(self, model=None, **kwargs):
        # Read by the overrides below, which run inside ZeroShardEngine.__init__ (a plain
        # attribute: the module itself cannot be set before nn.Module's own __init__).
        self._grid = model.mpu()
        super().__init__(model=model, **kwargs)  # builds the schedule in _check_setup
        self._links = StageLinks(self._world_comm, self.device, dynamic_shape=self.module.dynamic_shape)
        # The gradient norm (clipping, fp16 overflow) covers every stage.
        self._pipe_comm = new_comm(self._grid.get_pipe_parallel_group()) if self.module.num_stages > 1 else None
        if self._pipe_comm is not None:
            self._core.set_model_parallel(self._pipe_comm)
            # The sub-groups' communicators have no store: a failure published in the world's
            # ends their blocked collectives too (a replica waiting in the data-parallel
            # reduction for a rank whose stage raised).
            subgroups = [self._comm, self._pipe_comm] + [c for _, _, c in self.module.tied_groups() if c is not None]
            for comm in subgroups:
                comm.follow_aborts_of(self._world_comm)
        # DeepSpeed's: the last stage's loss summed over the last train_batch's micro-batches (None
        # elsewhere; eval_batch leaves it alone, where DeepSpeed's adds its losses to it), and the
        # mean loss train_batch returned.
        self.total_loss = None
        self.agg_train_loss = None
        # (op, micro-batch, chunk, start, end) per instruction of each train_batch, and per wait
        # for received data (list_run.WAIT_NAMES), on the monotonic clock every process shares,
        # when a benchmark sets it to a list.
        self._timeline = None
        self._batch_fn = None
        self.has_attention_mask = False
        self.data_iterator = None
        if self.training_dataloader is not None and self._needs_data():
            self.data_iterator = RepeatingLoader(self.training_dataloader)
        report = self._schedule_report
        peaks = report["peak_activations"]
        log_rank0(f"pipeline: {self.module.num_stages} stages x {self.dp_world_size} data-parallel, "
                  f"schedule {self._schedule}" + (f" with {self.module.virtual_stages} chunks per rank"
                                                  if self.module.virtual_stages > 1 else "") +
                  f", {self._gas} micro-batches per step; bubble {report['bubble_fraction']:.3f} at "
                  f"unit costs, activations held at once per stage {peaks}" +
                  (" until each input-gradient pass (the graphs stay until the weight passes: up to "
                   f"{self.module.num_stages} per stage)" if self._schedule == "zero_bubble" else ""),
                  self.global_rank)

    # ----- the axes (ZeroShardEngine's set-up calls these) -----
    def _all_ranks_comm(self):
        return self._world_comm

    def _data_parallel_size(self, mpu):
        stage = _C.engine_settings(self._config)["stage"]
        if not pipeline_accepts(stage):
            raise ValueError(f"zero_optimization.stage: got {stage} with a PipelineModule; a "
                             "pipeline runs with stage 0 or 1 across its data-parallel axis (stages "
                             "2 and 3 reduce or gather every micro-batch, which the schedule's "
                             "interleaving of micro-batches does not fit, as in DeepSpeed)")
        if mpu is not None:
            raise ValueError("initialize: mpu with a PipelineModule; the module's topology is the "
                             "grid (PipelineModule(topology=...))")
        return self._grid.get_data_parallel_world_size()

    def _data_parallel_rank(self):
        return self._grid.get_data_parallel_rank()

    def _make_comm(self):
        # Point-to-point goes over the world (global ranks), whose communicator has the store:
        # a stage's failure is published there and named in every rank's error. Made first:
        # _numbered_groups uses it before the core is built.
        self._world_comm = new_comm()
        # One stage: the data axis is the world, whose communicator has the store (errors name
        # every rank); a subgroup's cannot share it (its ranks' keys would collide).
        if self._grid.get_pipe_parallel_world_size() == 1:
            return new_comm()
        return new_comm(self._grid.get_data_parallel_group())

    def _numbered_groups(self, groups, passed_empty):
        """A script builds its groups from its stage's parameters, so a group can be empty on one
        stage: it stays wherever some stage passed parameters in it, so that every stage numbers the
        groups alike (checkpoint/groups.py; DeepSpeed's stages each number their own). Stages whose
        lists differ (in length, or in a group's hyper-parameters at one place: a script that passes
        each stage its non-empty groups only) cannot be lined up: each numbers its own, and a
        checkpoint of the run then loads its weights but not its optimizer state (load.py)."""
        comm, n = self._all_ranks_comm(), float(len(groups))
        counts = torch.tensor([n, -n], dtype=torch.float64, device=self.device)
        comm.all_reduce_max(counts, "initialize: how many param groups each stage passed")
        alike = float(counts[0]) == -float(counts[1])
        if alike:  # max(x) == -max(-x) exactly where every rank has the same x
            keys = [group_fingerprint(g) for g, _ in groups]
            seen = torch.tensor(keys + [-k for k in keys] + [0.0 if e else 1.0 for e in passed_empty],
                                dtype=torch.float64, device=self.device)
            comm.all_reduce_max(seen, "initialize: the param groups each stage passed")
            seen = seen.tolist()
            alike = seen[:len(keys)] == [-k for k in seen[len(keys):2 * len(keys)]]
        if alike:
            return [g for g, somewhere in zip(groups, seen[2 * len(keys):]) if somewhere], True
        log_rank0("warning: the pipeline's stages passed different lists of param groups (their number, or a "
                  "group's hyper-parameters at one place), so each stage numbers its own: a checkpoint of this "
                  "run loads its weights but not its optimizer state; pass the same list of groups on every "
                  "stage (a group may hold no parameters on a stage) to resume both", self.global_rank)
        return super()._numbered_groups(groups, passed_empty)[0], False

    def _check_setup(self, groups):
        """The pipeline block and the schedule's own rules, checked (and the schedule built)
        before any communicator exists, as ZeroShardEngine's checks: see there."""
        super()._check_setup(groups)
        settings = self._settings["pipeline"]
        self._check_pipeline_config(settings)
        self._schedule = settings["schedule"]
        lists, report = build_schedule(self._schedule, self.module.num_stages, self._gas,
                                       self.module.virtual_stages)
        self._instructions = lists[self.module.stage_id]
        self._schedule_report = report

    def _check_pipeline_config(self, settings):
        stages = settings["stages"]
        if stages != "auto" and int(stages) != self.module.num_stages:
            raise ValueError(f"pipeline.stages: got {stages}, the PipelineModule has "
                             f"{self.module.num_stages} stages (num_stages / topology)")
        # DeepSpeed takes these from the PipelineModule; a config value that disagrees with it
        # would silently not apply, so it is an error.
        module_side = {"partition": (self.module.partition_method, "best", "partition_method"),
                       "seed_layers": (self.module.seed_layers, False, "seed_layers")}
        for key, (used, default, argument) in module_side.items():
            if settings[key] != default and settings[key] != used:
                raise ValueError(f"pipeline.{key}: got {settings[key]!r}, but the PipelineModule was built "
                                 f"with {argument}={used!r}, which is what runs; pass it to "
                                 "PipelineModule (or leave the key out)")
        # As DeepSpeed's engine: a positive interval in the config is the one that runs.
        interval = int(settings["activation_checkpoint_interval"])
        if interval > 0 and interval != self.module.activation_checkpoint_interval:
            log_rank0(f"pipeline.activation_checkpoint_interval {interval} replaces the PipelineModule's "
                      f"{self.module.activation_checkpoint_interval}, as in DeepSpeed", self.global_rank)
            self.module.activation_checkpoint_interval = interval
        if settings["virtual_stages"] != self.module.virtual_stages:
            raise ValueError(f"pipeline.virtual_stages: got {settings['virtual_stages']}, the "
                             f"PipelineModule was built with virtual_stages="
                             f"{self.module.virtual_stages}; pass the same to both")
        if self.config["flops_profiler"]["enabled"]:
            note_rank0("warning: flops_profiler.enabled: a PipelineEngine's instructions are not counted: "
                       "no profile is printed and the progress line shows no TFLOPS", self.global_rank)

    # ----- what DeepSpeed's pipeline engine refuses -----
    def forward(self, *args, **kwargs):
        raise PipelineError(_TRAIN_ONLY)

    def backward(self, *args, **kwargs):
        raise PipelineError(_TRAIN_ONLY)

    def step(self, *args, **kwargs):
        raise PipelineError(_TRAIN_ONLY)

    # ----- DeepSpeed's queries -----
    def is_first_stage(self):
        return self.module.stage_id == 0

    def is_last_stage(self):
        return self.module.stage_id == self.module.last_stage_rank

    @property
    def num_stages(self):
        return self.module.num_stages

    @property
    def stage_id(self):
        return self.module.stage_id

    @property
    def grid(self):
        return self._grid

    @property
    def mpu(self):
        return self._grid

    @property
    def is_pipe_parallel(self):
        return self.module.num_stages > 1

    @property
    def is_data_parallel(self):
        return self.dp_world_size > 1

    @property
    def micro_batches(self):
        return self._gas

    def set_dataiterator(self, iterator):
        self.data_iterator = iterator

    def set_dataloader(self, loader):
        """DeepSpeed's: train from this loader (restarted when it ends) from the next train_batch."""
        if self._needs_data():
            self.training_dataloader = loader
            self.data_iterator = RepeatingLoader(loader)

    def set_batch_fn(self, fn):
        """DeepSpeed's (Megatron-DeepSpeed passes its batch function): every item the data
        iterator yields goes through fn before it is split into (inputs, labels)."""
        self._batch_fn = fn

    def set_has_attention_mask(self, value):
        """DeepSpeed's (GPT-NeoX calls it) marks an attention mask among the boundary tensors so
        that it gets no gradient; here only floating tensors ever require one, so a mask (bool or
        integer) crosses stages as it is whatever this says. Kept for DeepSpeed's reader."""
        if not isinstance(value, bool):
            raise ValueError(f"set_has_attention_mask: got {value!r}, expected True or False")
        self.has_attention_mask = value

    def reset_activation_shape(self):
        """DeepSpeed's: the tensors crossing stage boundaries may change shape from the next
        train_batch or eval_batch (every rank calls it), agreed again at its first micro-batch."""
        self._links.forget_layouts()

    def get_additional_losses(self):
        """DeepSpeed's (Megatron-DeepSpeed reads it every step): the module's additional losses
        (MoE's) averaged over the last train_batch. A PipelineModule whose get_additional_losses
        returns any is refused at its first micro-batch (_loss_of), so this is None."""
        return None

    def schedule_report(self):
        """The checker's report of this run's schedule (unit costs): peak activations per stage
        and the bubble fraction."""
        return dict(self._schedule_report)

    def _checkpoint_placement(self):
        """Which of this stage's pieces this rank writes (read by checkpoint/layout.py's RunView)."""
        from zeroshard.checkpoint.pipeline import placement_of
        return placement_of(self)

    # ----- data and loss -----
    def _needs_data(self):
        return self.module.stage_id in (0, self.module.last_stage_rank)

    def _next_micro_batch(self, data_iter, mb):
        source = data_iter if data_iter is not None else self.data_iterator
        if source is None:
            raise ValueError("train_batch: no data; pass data_iter or initialize(training_data=...)")
        batch = next(source)
        if self._batch_fn is not None:
            batch = self._batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"pipeline: micro-batch {mb} is {type(batch).__name__}"
                             f"{' of ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}; "
                             "expected (inputs, labels), each a tensor or a tuple of tensors")
        # Each part goes to the device only on the rank that uses it: the inputs on the first
        # stage's, the labels on the last stage's.
        first, last = self.module.stage_id == 0, self.module.stage_id == self.module.last_stage_rank
        return (_to(batch[0], self.device) if first else None, _to(batch[1], self.device) if last else None)

    def _loss_of(self, outputs, labels, mb):
        if self.module.loss_fn is None:
            loss = outputs  # the last layer computes the loss itself
        else:
            loss = self.module.loss_fn(outputs, labels)
        if self.module.get_additional_losses():  # None or {}: none (DeepSpeed reads {} as none too)
            raise PipelineError(f"pipeline: micro-batch {mb}: the PipelineModule's get_additional_losses() "
                                "returned losses (DeepSpeed averages MoE's and reports them beside the loss); "
                                "zeroshard's pipeline does not: return None, and log them from the module")
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(f"pipeline: the loss of micro-batch {mb} is "
                             f"{type(loss).__name__}{list(loss.shape) if torch.is_tensor(loss) else ''}; "
                             "expected a one-element tensor (loss_fn(outputs, labels), or the last "
                             "layer's output without loss_fn)")
        return loss

    def _report_stage_failure(self, error, what):
        """Publishes `what` failed in the world communicator's store, with the error's type and
        first line (other ranks' errors name both, so rank 0's log says what went wrong on another
        stage; a failed collective's own report is not nested in it), and adds the all-rank report
        to the error."""
        lines = str(error).strip().splitlines()
        if isinstance(error, _C.CommError):  # its headline ("collective timeout after 60 s on ..."), not its report
            what += f" met {lines[0].split(': ', 1)[0][:_CAUSE_CHARS]}" if lines else " met a CommError"
        else:
            what += f" raised {type(error).__name__}" + (f": {lines[0][:_CAUSE_CHARS]}" if lines else "")
        try:
            self._world_comm.fail_here(what, "")  # the description carries the cause
        except _C.CommError as report:
            error.add_note(f"[zeroshard] {report}")

    def _name_comm_failure(self, error, what):
        """The data-parallel, tie and pipe communicators have no store: when one of their
        collectives fails (a peer's process ended after its stage raised), the world's store
        names who failed first, in a note on the error. A failed send or receive (the world's)
        names it already."""
        if "pipeline stage" not in str(error):
            self._report_stage_failure(error, what)

    @contextlib.contextmanager
    def _stage_failure_reported(self, what):
        """Around one stage's own work (train_batch's instructions, eval_batch's forwards): an
        error of this rank's is published in the world's store, so every other rank's error
        names `what`; a failed sub-group collective gets the world's report instead."""
        try:
            yield
        except _C.CommError as error:
            self._name_comm_failure(error, what)
            raise
        except BaseException as error:
            self._report_stage_failure(error, what)
            raise

    @contextlib.contextmanager
    def _named_by_world(self, what):
        try:
            yield
        except _C.CommError as error:
            self._name_comm_failure(error, f"pipeline stage {self.module.stage_id} {what}")
            raise

    # ----- training -----
    def train_batch(self, data_iter=None):
        """Runs gradient_accumulation_steps micro-batches through the schedule and steps; returns
        the mean loss (over micro-batches and data-parallel ranks) on every rank."""
        self._refuse_if_destroyed()
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch: gradients are disabled (inside torch.no_grad()?); use "
                               "eval_batch to evaluate")
        if data_iter is not None:
            self.set_dataiterator(data_iter)  # as DeepSpeed: a later train_batch() reads on from it
        self.module.train()
        self._observer.pipeline_step_begin()
        run = TrainStep(self, self.data_iterator)
        run.run(self._instructions)
        self.total_loss = torch.stack(run.losses).sum() if run.losses else None
        with self._named_by_world("loss all-reduce and optimizer step"):
            loss = self._share_loss(run.losses)
            self.agg_train_loss = loss
            self._observer.pipeline_loss(loss)
            self._step_after_schedule()
        return loss

    def _step_after_schedule(self):
        duplicate = 0.0
        for key, stages, _ in self.module.tied_groups():
            if not self.module.counts_tie(key):
                for _, w in self.module.trained_tied_weights(key):
                    duplicate += float(w.grad.double().pow(2).sum())
        self._observer.step_begin()
        self.optimizer.apply_step(self._train_batch_size, duplicate)
        self._after_core_step()
        for _ in range(self._gas):
            self._core.state.count_micro_step()
        self._observer.step_end(True)

    def _share_loss(self, losses):
        """The last stage's mean loss, averaged over its data-parallel ranks, on every rank."""
        last = self.module.last_stage_rank
        local = float(torch.stack(losses).float().mean()) if losses else 0.0
        total = local if self.module.stage_id == last else 0.0
        if self.dp_world_size > 1:
            total = self._comm.all_reduce_values([total], str(self.device), "pipeline loss")[0] / self.dp_world_size
        if self._pipe_comm is not None:
            total = self._pipe_comm.all_reduce_values([total], str(self.device), "pipeline loss")[0]
        return torch.tensor(total, device=self.device)  # on the device, as DeepSpeed returns it

    # ----- evaluation -----
    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """Forward only over num_micro_batches (default gradient_accumulation_steps) micro-batches;
        returns the loss (mean over micro-batches, and over data-parallel ranks with
        reduce_output="avg") on every rank, and with return_logits the last stage's outputs
        (None on other ranks)."""
        from zeroshard.pipe.evaluate import run_eval
        return run_eval(self, data_iter, return_logits, compute_loss, reduce_output, bcast_loss,
                        self._gas if num_micro_batches is None else num_micro_batches)


def _to(part, device):
    if isinstance(part, (tuple, list)):
        return tuple(_to(p, device) for p in part)
    return part.to(device) if torch.is_tensor(part) else part
