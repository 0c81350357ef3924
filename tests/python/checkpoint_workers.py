"""What the engine-level checkpoint tests run on every rank: build an engine from a small config,
train it on the shared deterministic batches, and read back everything a resume must restore as
numpy arrays and plain numbers (torch tensors do not survive the result queue)."""
import os

import numpy as np
import torch

from models import MODELS, global_batch

LR = 1e-3


def config(stage, precision="fp32", micro=2, gas=1, scheduler=None, train_batch=None, extra=None):
    """A DeepSpeed-style config. `scheduler`: None, or (type, params) of a config schedule."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        # Stage 3 partitions every parameter here (the default threshold would keep them whole).
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "steps_per_print": 1000,
    }
    if train_batch is not None:
        cfg["train_batch_size"] = train_batch
    if scheduler is not None:
        cfg["scheduler"] = {"type": scheduler[0], "params": dict(scheduler[1])}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        # A start far too high and a short window: the first steps overflow and are skipped, then the
        # scale grows every 2 clean steps and overflows again, so the scaler's whole state moves.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 2, "hysteresis": 2}
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def client_scheduler(kind):
    """A torch scheduler built on engine.optimizer, as DeepSpeed scripts pass it to initialize."""
    if kind is None:
        return None
    if kind == "LambdaLR":
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.3 * step))
    if kind == "StepLR":
        return lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    raise AssertionError(kind)


def build(model_name, cfg, scheduler_kind=None):
    return build_module(MODELS[model_name](), cfg, scheduler_kind)


def build_module(model, cfg, scheduler_kind=None):
    import zeroshard
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           lr_scheduler=client_scheduler(scheduler_kind))
    return engine


def train(engine, model_name, first, last):
    """Global steps first..last-1 on the shared batches; returns this rank's micro-batch losses."""
    rank, world = engine.global_rank, engine.world_size
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, last):
        batch = global_batch(model_name, step, micro * gas * world)
        if batch.is_floating_point():  # AwkwardMLP's inputs, in the model's dtype
            batch = batch.to(engine.dtype)
        for m in range(gas):
            start = (m * world + rank) * micro
            loss = engine(batch[start:start + micro])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _np(t):
    # A copy: for fp32 on the CPU, .float().cpu().numpy() would share the live storage, and the
    # snapshot would follow later steps.
    return None if t is None else t.detach().float().cpu().numpy().copy()


def snapshot(engine, module_weights=True):
    """Everything a resume must restore, as numpy and plain values. full_values.get is collective at
    stage 3, so every rank calls this at the same point."""
    core = engine._core
    fv = core.full_values
    held = engine._gathered if core.strategy.partitions_params else engine._params
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {
        # The core's trainable parameters (stage 3's frozen ones follow them in `held`).
        "names": [names[id(p)] for p in held[:core.num_params]],
        "fp32": [_np(fv.get(i, "fp32_param")) for i in range(core.num_params)],
        "states": {s: [_np(fv.get(i, s)) for i in range(core.num_params)] for s in core.state_names},
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.get_loss_scale(),
        "lr": engine.get_lr(),
        "group_steps": list(core.state.state_dict()["group_steps"]),
    }
    if module_weights:
        out["module"] = module_state(engine)
        out["module_dtype"] = str(engine.dtype)
    return out


def module_state(engine):
    """The module's own weights (16-bit in a 16-bit run) and persistent buffers by name; gathered
    (collectively) under ZeRO-3."""
    if engine._core.strategy.partitions_params:
        from zeroshard.zero.gathered import GatheredParameters
        with GatheredParameters(list(engine.module.parameters())):
            return {n: _np(t) for n, t in engine.module.state_dict().items()}
    return {n: _np(t) for n, t in engine.module.state_dict().items()}


def rank_and_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def equal_arrays(a, b):
    """Bit-for-bit equality of two lists (or dicts) of arrays (None for a state not made yet)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_arrays(a[k], b[k]) for k in a)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))):
            return False
    return True
