"""The engine that wraps the user's nn.Module: DeepSpeed's initialize() and engine API. Python
orchestrates (hooks, data, logging); buffers, reduction and the optimizer step live in C++."""
import contextlib
import gc
import json
import os

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.accelerator import get_accelerator
from zeroshard.comm import device as comm_device
from zeroshard.comm import init_distributed, new_comm, release_at_exit
from zeroshard.config import config_changes, load_config
from zeroshard.dataloader import make_dataloader
from zeroshard.dtypes import PRECISIONS
from zeroshard.engine_setup import check_partitioned, param_groups
from zeroshard.log import log_rank0, logger, note_rank0
from zeroshard import model_save
from zeroshard.engine_names import DEEPSPEED_ENGINE_NAMES
from zeroshard.lr_schedules import ConfigLRScheduler
from zeroshard.observe import Observer
from zeroshard.observe import comms as observe_comms
from zeroshard.optimizer import ZeroShardOptimizer, client_optimizer_spec, held_groups
from zeroshard.zero import hooks as zero_hooks
from zeroshard.zero.partition_init import full_shape



def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """DeepSpeed's initialize(): returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    if model is None:
        raise ValueError("initialize: model is required")
    if mesh_param is not None:
        raise ValueError("initialize: mesh_param (sequence/tensor-parallel meshes) is not supported")
    # A model that needs another engine names it (PipelineModule: zeroshard/pipe/engine.py's), so
    # this module never imports the engines built on it.
    engine_for = getattr(model, "_zeroshard_engine_class", None)
    engine_class = engine_for() if engine_for is not None else ZeroShardEngine
    if engine_for is None:
        _warn_unused_pipeline_keys(args, config, config_params)
    engine = engine_class(args=args, model=model, optimizer=optimizer,
                             model_parameters=model_parameters, training_data=training_data,
                             lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn,
                             config=config, config_params=config_params)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _warn_unused_pipeline_keys(args, config, config_params):
    """The "pipeline" block acts only on a PipelineModule; set for another model it is said once."""
    changed = [c for c in config_changes(load_config(args, config, config_params)) if c.startswith("pipeline.")]
    if changed:
        log_rank0("warning: the config's pipeline block (" + ", ".join(changed) + ") has no effect: "
                  "the model is not a zeroshard.pipe.PipelineModule", int(os.environ.get("RANK", "0")))


class ZeroShardEngine(torch.nn.Module):
    # initialize(training_data=...)'s loader shuffles each epoch, as DeepSpeed's engine's does.
    _shuffles_training_data = True

    def __init__(self, args=None, model=None, optimizer=None, model_parameters=None,
                 training_data=None, lr_scheduler=None, distributed_port=29500, mpu=None,
                 dist_init_required=None, collate_fn=None, config=None, config_params=None):
        super().__init__()
        self._config = load_config(args, config, config_params)
        # DeepSpeed's engine.config, a dict (Trainer.save_model reads it): here the resolved config,
        # every key the given one has and the defaults of the rest (comments in a file are fine).
        self.config = json.loads(self._config.resolved_json())
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = self._data_parallel_size(mpu)
        self._mpu = mpu
        tbs, micro, gas = self._config.resolve_batch(self.dp_world_size)
        self._train_batch_size, self._micro_batch_size, self._gas = tbs, micro, gas
        s = _C.engine_settings(self._config)
        self._settings = s
        for note in self._config.notes:
            note_rank0(note, self.global_rank)
        if os.environ.get("ZEROSHARD_PRINT_CONFIG", "0") not in ("", "0"):
            log_rank0("config in force: " + self._config.resolved_json(), self.global_rank)
        else:
            changes = config_changes(self._config)
            log_rank0("config: the defaults" + (" except:" if changes else "") +
                      "".join(f"\n  {c}" for c in changes) +
                      "\n  (ZEROSHARD_PRINT_CONFIG=1 prints the whole resolved config)", self.global_rank)
        _C.require_buildable(self._config)  # before the model is touched
        if s["cpu_checkpointing"]:  # zeroshard.checkpointing.checkpoint keeps its inputs on the host
            from zeroshard import checkpointing
            # Only that setting: the config reader has said what the block's other keys do.
            checkpointing.configure(None, checkpoint_in_cpu=True)

        self.device = comm_device()
        self.module = model.to(self.device)
        self.dtype = PRECISIONS[s["precision"]]
        self._client_optimizer = None  # a torch optimizer the script built, which never steps itself
        spec, groups, passed_empty = self._optimizer_spec(optimizer, model_parameters)
        self._check_setup(groups)
        self._comm = self._make_comm()
        release_at_exit(self)
        groups, alike = self._numbered_groups(groups, passed_empty)
        self._build_core(spec, groups)
        self.optimizer = ZeroShardOptimizer(self._core, [g for g, _ in groups], numbered_alike=alike)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.training_dataloader = (
            make_dataloader(training_data, self._micro_batch_size, self.dp_world_size,
                            self._data_parallel_rank(), collate_fn, s["dataloader_drop_last"],
                            shuffle=self._shuffles_training_data)
            if training_data is not None else None)

        self._boundary_override = None
        self._in_no_sync = False
        self._observer = Observer(self)
        log_rank0(f"ZeRO stage {self._core.strategy.stage}, {s['precision']}, world {self.world_size}, "
                  f"batch {tbs} = micro {micro} x gas {gas} x dp {self.dp_world_size}, "
                  f"{self._core.num_params} trainable tensors in {self._core.num_buckets} gradient "
                  f"bucket(s); model state per rank: {self._core.memory.summary()}", self.global_rank)
        if self._core.swap_backend:
            kinds = (("optimizer state", "offload_optimizer"), ("parameters", "offload_param"))
            what = " and ".join(w for w, k in kinds if s[k] == "nvme")
            log_rank0(f"NVMe {what}: I/O through {self._core.swap_backend}", self.global_rank)

    # ----- set-up -----
    # The data-parallel axis; the pipeline engine (zeroshard/pipe/engine.py) overrides all three.
    def _data_parallel_size(self, mpu):
        size = mpu.get_data_parallel_world_size() if mpu is not None else self.world_size
        if size != self.world_size:
            raise ValueError(f"mpu: data-parallel size {size} != world size {self.world_size}; "
                             "model (tensor/pipeline) parallelism through mpu is not supported, so "
                             "every rank must be a data-parallel rank (pipelines: build a "
                             "zeroshard.pipe.PipelineModule)")
        return size

    def _data_parallel_rank(self):
        return self.global_rank

    def _make_comm(self):
        return new_comm()

    def _check_setup(self, groups):
        """Checks that every rank makes alike, run before any communicator exists: a rank that
        raises here leaves no other connecting to its store (rank 0's goes when its process ends)."""
        check_partitioned(self.module, groups, self._settings["stage"])

    def _optimizer_spec(self, client_optimizer, model_parameters):
        if client_optimizer is not None and not isinstance(client_optimizer, torch.optim.Optimizer):
            if callable(client_optimizer):
                client_optimizer = client_optimizer(self.module.parameters() if model_parameters is None
                                                    else model_parameters)
            else:
                raise ValueError("optimizer: expected a torch.optim.Optimizer or a callable that "
                                 "builds one from the parameters")
        configured = _C.optimizer_config(self._config)
        if client_optimizer is not None:
            if configured["present"]:
                raise ValueError("optimizer: given both in the config's \"optimizer\" block and as "
                                 "initialize(optimizer=...); pass only one")
            spec = client_optimizer_spec(client_optimizer, _C.engine_settings(self._config))
            self._client_optimizer = client_optimizer
            defaults = {}
        elif configured["present"]:
            spec = None  # the config's optimizer block, which C++ keeps
            defaults = configured["group_defaults"]
        else:
            raise ValueError("optimizer: none given; add an \"optimizer\" block to the config "
                             "(e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass "
                             "initialize(optimizer=...)")
        return (spec, *param_groups(self.module, model_parameters, client_optimizer, defaults))

    def _numbered_groups(self, groups, passed_empty):
        """(optimizer.param_groups' groups, whether every rank numbers them alike): a group passed
        with no parameters at all is removed, as DeepSpeed's engine removes it."""
        return [g for g, empty in zip(groups, passed_empty) if not empty], True

    def _build_core(self, spec, groups):
        groups = [groups[i] for i in held_groups([g for g, _ in groups])]
        trainable_ids = {id(p) for _, ps in groups for p in ps}
        fp32_values = [[p.detach().to(torch.float32) for p in ps] for _, ps in groups]
        # Frozen parameters of a floating dtype: stage 3 partitions them too (in C++). Trainable
        # ones outside the optimizer's groups and integer ones stay whole.
        frozen = [p for p in self.module.parameters()
                  if not p.requires_grad and p.is_floating_point() and id(p) not in trainable_ids]
        # Frozen parameters and buffers follow rank 0 too, through the same C++ broadcast as the
        # trainable ones (ZeroOptimizer's); chunks from zero.Init already hold rank 0's values.
        synced = [(name, t.data) for name, t in list(self.module.named_buffers()) + [
            (n, p) for n, p in self.module.named_parameters() if id(p) not in trainable_ids]
            if full_shape(t) is None]
        # One broadcast per tensor, so that a hang report names it ("initial <name>").
        _C.broadcast_from_rank0(self._comm, [t for _, t in synced], [n for n, _ in synced], "initial")
        with torch.no_grad():
            self.module.to(self.dtype)
        unoptimized = [n for n, p in self.module.named_parameters()
                       if p.requires_grad and id(p) not in trainable_ids]
        if unoptimized:
            log_rank0(f"warning: {len(unoptimized)} parameter(s) require grad but are in no "
                      f"optimizer group ({', '.join(unoptimized[:3])}): they stay whole on every "
                      "rank, their .grad accumulates and no step updates them; freeze them with "
                      "requires_grad_(False) if they are not to be trained", self.global_rank)
        shapes = [[full_shape(p) for p in ps] for _, ps in groups]
        frozen_shapes = [full_shape(p) for p in frozen]
        self._core = _C.ZeroOptimizer(self._comm, self._config, spec, fp32_values, self.dtype,
                                      [[None if s is None else list(s) for s in ss] for ss in shapes],
                                      frozen, [None if s is None else list(s) for s in frozen_shapes])
        self._params = [p for _, ps in groups for p in ps]
        self._frozen_release = None  # stage 3 with partitioned frozen parameters only
        if self._core.strategy.partitions_params:
            # Stage 3: each rank keeps its chunks; modules gather their parameters when they run.
            self._gathered = self._params + frozen
            shapes = [torch.Size(p.shape if full_shape(p) is None else full_shape(p))
                      for p in self._gathered]
            self._core.gatherer.attach(self._gathered)
            policy = _C.FrozenRelease(self._comm, str(self.device))
            self._zero3_hooks, any_frozen = zero_hooks.install(
                self._core, self.module, self._gathered, policy)
            self._frozen_release = policy if any_frozen else None
            for i, (p, shape) in enumerate(zip(self._gathered, shapes)):
                # DeepSpeed's names for the whole shape, which scripts read while p is empty
                # (peft counts parameters by ds_numel).
                p.ds_id, p.ds_shape, p.ds_numel = i, shape, shape.numel()
        else:
            for p, view in zip(self._params, (v for vs in self._core.param_views() for v in vs)):
                p.data = view
        # The core's index of each parameter it holds, for GatheredParameters and zeroshard.utils.
        for i, p in enumerate(self._gathered if self._core.strategy.partitions_params else self._params):
            p._zeroshard_core, p._zeroshard_index = self._core, i
        if self._core.strategy.keeps_full_grads:
            self._grad_views = [v for vs in self._core.grad_views() for v in vs]
        else:
            self._grad_views = [None] * len(self._params)
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._grad_hooks = []
        for i, (p, g) in enumerate(zip(self._params, self._grad_views)):
            p.grad = None  # stages 0/1: the first backward moves it into its flat-buffer view
            self._grad_hooks.append(
                p.register_post_accumulate_grad_hook(self._make_hook(i, g, names.get(id(p), f"#{i}"))))

    def _make_hook(self, index, view, name):
        core = self._core
        if view is None:
            # Sharded gradients: every backward hands each gradient to C++, which stages and
            # reduces it; the full-size gradient is dropped at once.
            def hand_over(param):
                try:
                    core.grad_ready(index, param.grad)
                except _C.Error as error:
                    error.add_note(f"[zeroshard] parameter {index} is {name}")
                    raise
                param.grad = None
            return hand_over

        def hook(param):
            # Full gradients accumulate in their flat-buffer view. After zero_grad param.grad is
            # None, so autograd makes a fresh tensor, which C++ copies into the view (as does a
            # script's replacement of param.grad); later backwards accumulate in the view itself.
            if param.grad is view:
                core.grad_ready(index, None)
            else:
                core.grad_ready(index, param.grad)
                param.grad = view
        return hook

    @staticmethod
    def _clean_up_after(error, abort):
        """Runs abort() after a forward or backward raised `error`. Not after a failed collective:
        the group is unusable, and waiting on the rest of its work would only replace the error
        that names the ranks and the collective."""
        if isinstance(error, _C.CommError):
            return
        try:
            abort()
        except Exception as cleanup:
            # The forward's or backward's own error is the one to see; the clean-up's goes with it.
            error.add_note(f"[zeroshard] cleaning up after it also failed: {cleanup}")

    def _drop_full_grads(self):
        """Stages 0/1 after the step or zero_grad: param.grad becomes None, as torch's
        zero_grad(set_to_none=True) and DeepSpeed leave it; the flat buffer is not cleared."""
        if self._core.strategy.keeps_full_grads:
            for p in self._params:
                p.grad = None

    def _make_scheduler(self, client_scheduler):
        if self._settings["scheduler"] is not None:
            if client_scheduler is not None:
                raise ValueError("scheduler: given both in the config's \"scheduler\" block and as "
                                 "initialize(lr_scheduler=...); pass only one")
            return ConfigLRScheduler(self.optimizer, self._config)
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(self.optimizer)
        return client_scheduler

    def destroy(self):
        """DeepSpeed's destroy (accelerate's free_memory calls it): the hooks the engine put on
        the model (ZeRO-3's gathers, the gradient hand-over) are removed, so the model and its
        memory can be freed; the engine cannot train after it."""
        for handle in self.__dict__.get("_zero3_hooks", []) + self.__dict__.get("_grad_hooks", []):
            handle.remove()
        self._zero3_hooks, self._grad_hooks = [], []
        if self.__dict__.get("_observer") is not None:
            self._observer.close()
        self._destroyed = True

    def _release_runtime(self):
        """At exit (comm.release_at_exit): destroy(), then every reference this engine made to
        its C++ runtime (communicator, optimizer core) is dropped, here and on the parameters."""
        self.destroy()
        for p in self.__dict__.get("_gathered") or self.__dict__.get("_params", []):
            p.__dict__.pop("_zeroshard_core", None)
            ref = getattr(p, "_zeroshard_init_comm", None)
            if ref is not None:
                ref.comm = None
        if self.__dict__.get("optimizer") is not None:
            self.optimizer.core = None
        for name in ("_core", "_comm", "_frozen_release"):
            self.__dict__.pop(name, None)

    def _refuse_if_destroyed(self):
        if self.__dict__.get("_destroyed"):
            raise RuntimeError("engine: destroy() was called (accelerate's free_memory calls it); "
                               "build a new engine with initialize() to train again")

    # ----- training API -----
    def forward(self, *inputs, **kwargs):
        self._refuse_if_destroyed()
        if self._settings["fp16_auto_cast"]:
            inputs = tuple(x.half() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
        self._observer.forward_begin()
        try:
            return self.module(*inputs, **kwargs)
        except BaseException as error:
            # ZeRO-3: what the forward gathered is released, so the next one starts clean.
            zero_hooks.forget_running(self._core)
            self._clean_up_after(error, self._core.abort_forward)
            raise
        finally:
            self._observer.forward_end()

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's and DeepSpeed's no_sync: backwards inside the block add to this rank's own
        gradients without reducing them; the first boundary backward after it reduces the sum.
        Stages 0 and 1 only: stages 2 and 3 keep only a shard of each gradient."""
        if not self._core.strategy.keeps_full_grads:
            raise RuntimeError(f"no_sync: ZeRO stage {self._core.strategy.stage} keeps only this rank's "
                               "shard of each gradient, so every backward must reduce; use "
                               "gradient_accumulation_steps to accumulate, or stage 0 or 1")
        if self._in_no_sync:
            raise RuntimeError("no_sync: already inside engine.no_sync(); blocks do not nest")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        self._boundary_override = is_boundary

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        self._refuse_if_destroyed()
        if not loss.requires_grad:
            raise ValueError("backward: the loss does not require grad (was it computed under "
                             "torch.no_grad(), or from detached outputs?)")
        self._observer.backward_begin()
        scaled = loss / self._gas if scale_wrt_gas else loss
        boundary = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        self._core.before_backward(boundary)
        try:
            if self._frozen_release is not None:
                self._frozen_release.begin_backward()
            (scaled * self._core.state.loss_scale).backward(retain_graph=retain_graph)
        except BaseException as error:
            # The next backward starts clean; this one's partial gradients stay until zero_grad().
            self._clean_up_after(error, self._core.abort_backward)
            self._observer.backward_end(None, None, boundary)
            raise
        finally:
            if self._frozen_release is not None:
                self._frozen_release.end_backward()
        self._core.after_backward(boundary)
        self._observer.backward_end(loss, scaled, boundary)
        if boundary and self._core.strategy.keeps_full_grads:
            # Parameters that got no gradient in the window: their views were zeroed by the reduction.
            for p, view in zip(self._params, self._grad_views):
                if p.grad is None:
                    p.grad = view
        return scaled

    def step(self, lr_kwargs=None):
        self._refuse_if_destroyed()
        if self._in_no_sync:
            raise RuntimeError("step: called inside engine.no_sync(), whose gradients are not "
                               "reduced yet; leave the block and run one more backward first")
        boundary = self.is_gradient_accumulation_boundary()
        self._observer.step_begin()
        if boundary:
            self.optimizer.apply_step(self._train_batch_size)
            self._after_core_step(lr_kwargs)
        self._observer.step_end(boundary)
        self._core.state.count_micro_step()
        self._boundary_override = None

    @property
    def _last(self):
        """The last step's StepResult, which the optimizer holds (its overflow reads it)."""
        return self.optimizer.last_step

    def _after_core_step(self, lr_kwargs=None):
        """What follows the C++ step in every engine: gradients dropped as DeepSpeed drops them,
        the scheduler stepped when the step was applied, a skipped fp16 step said."""
        self._drop_full_grads()
        if self._last.applied:
            # torch schedulers warn unless they see the optimizer was stepped first; one built
            # on the script's own optimizer watches that one.
            for opt in (self.optimizer, self._client_optimizer):
                if opt is not None:
                    opt._opt_called = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            log_rank0(f"step {self.global_steps}: fp16 gradient overflow, step skipped; "
                      f"loss scale {self._last.loss_scale:g} -> {self._core.state.loss_scale:g}",
                      self.global_rank)

    def zero_grad(self):
        self._core.zero_grad()
        self._drop_full_grads()

    # ----- queries -----
    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return None if self._last is None or not self._last.applied else self._last.grad_norm

    def was_step_applied(self) -> bool:
        return bool(self._last is not None and self._last.applied)

    def train_batch_size(self):
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self._micro_batch_size

    def gradient_accumulation_steps(self):
        return self._gas

    def zero_optimization_stage(self):
        return self._core.strategy.stage

    def get_loss_scale(self):
        return self._core.state.loss_scale

    # DeepSpeed's counters, read from the one training state (runtime/training_state.h).
    @property
    def global_steps(self):
        return self._core.state.global_steps

    @property
    def micro_steps(self):
        return self._core.state.micro_steps

    @property
    def global_samples(self):
        return self._core.state.global_samples

    @property
    def skipped_steps(self):
        return self._core.state.skipped_steps

    @property
    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", "0"))

    def fp16_enabled(self):
        return self._settings["precision"] == "fp16"

    def bfloat16_enabled(self):
        return self._settings["precision"] == "bf16"

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """Writes the module's 16-bit state_dict from rank 0 (all ranks must call it). Under ZeRO-3
        it gathers the parameters only when stage3_gather_16bit_weights_on_model_save is set, and
        otherwise returns False without writing, as DeepSpeed does."""
        return model_save.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save (accelerate and Trainer ask
        before they call _zero3_consolidated_16bit_state_dict)."""
        return bool(self._settings["gather_16bit_weights_on_model_save"])

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's name for the whole model's state_dict on rank 0 (None elsewhere); every
        rank calls it. Any stage (below stage 3 no gather is needed)."""
        return model_save.consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's save_checkpoint: every rank calls it; writes save_dir/<tag>/ (default tag
        global_step<N>) atomically and, with save_latest, save_dir/latest (zeroshard/checkpoint)."""
        from zeroshard.checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load_checkpoint: returns (load_path, client_state), or (None, None) when
        load_dir has no `latest` and no tag is given. Reshards to this run's world and stage."""
        from zeroshard.checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _all_ranks_comm(self):
        """The communicator every rank of the job is in (a pipeline's data axis is only part)."""
        return self._comm

    def comms_summary(self):
        """The comms logger's table so far (comms_logger.enabled), printed on rank 0 and
        returned, as DeepSpeed's deepspeed.comm.log_summary()."""
        text = observe_comms.summary()
        log_rank0(text, self.global_rank)
        return text

    @property
    def mpu(self):
        """DeepSpeed's: the model-parallel unit initialize was given (None without one)."""
        return self._mpu

    def empty_partition_cache(self):
        """DeepSpeed's: at stage 3 releases the gathered parameters nothing holds (zero/hooks.py),
        then collects garbage and empties the device's cache; every rank calls it at the same
        point (the next gathers are collectives). Below stage 3 nothing is gathered: it does
        nothing, as DeepSpeed's. Departure: persistent parameters stay whole (DeepSpeed releases
        them too)."""
        self._refuse_if_destroyed()
        if self._core.strategy.partitions_params:
            zero_hooks.empty_partition_cache(self._core)
            gc.collect()
            get_accelerator().empty_cache()

    def memory_bytes(self):
        """Model-state bytes held by this rank, by category, from the runtime's own accounting."""
        return dict(self._core.memory.bytes())

    def memory_peak_bytes(self):
        """The most bytes this rank held in each category since the start or reset_memory_peaks()."""
        return dict(self._core.memory.peak_bytes())

    def reset_memory_peaks(self):
        self._core.memory.reset_peaks()

    def resolved_config(self) -> dict:
        return json.loads(self._config.resolved_json())

    def __getattr__(self, name):
        # nn.Module keeps submodules in _modules; fall back to the wrapped module like DeepSpeed.
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in DEEPSPEED_ENGINE_NAMES:
            # Never the wrapped module's attribute of the same name (engine.config is not the
            # model's config): a DeepSpeed engine name zeroshard lacks is an error that says so.
            raise AttributeError(f"'{type(self).__name__}' has no attribute {name!r}: DeepSpeed's "
                                 f"engine has {name!r}, zeroshard's does not implement it, and the "
                                 f"wrapped model's {name!r} is not answered in its place (use "
                                 f"engine.module.{name} for the model's)")
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None:  # still being built (initialize raised before the module was set)
            raise AttributeError(f"'{type(self).__name__}' has no attribute {name!r}: the engine "
                                 "was not built (initialize() did not finish)")
        try:
            return getattr(module, name)
        except AttributeError as error:
            # Chained: a property of the module that raised AttributeError itself shows there.
            raise AttributeError(f"'{type(self).__name__}' has no attribute {name!r}, nor has the "
                                 f"{type(module).__name__} it wraps") from error


DeepSpeedEngine = ZeroShardEngine  # deepspeed.runtime.engine.DeepSpeedEngine
