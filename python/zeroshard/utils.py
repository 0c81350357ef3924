"""DeepSpeed's deepspeed.utils helpers that read a whole parameter's state when ZeRO keeps only a
shard of it on each rank: its fp32 master values, its gradient and its optimizer state. Each
assembles the tensor from every rank's shard (one all-reduce of the parameter's size where the
state is sharded), so every rank must call it, in the same order."""
import torch


def _owner(param):
    core = getattr(param, "_zeroshard_core", None)
    return (core, param._zeroshard_index) if core is not None else (None, None)


def safe_get_full_fp32_param(param: torch.nn.Parameter):
    """The parameter's whole fp32 value (the master copy under bf16/fp16), or None for a tensor
    the engine does not hold (not a parameter of its module, or frozen below stage 3)."""
    core, index = _owner(param)
    return None if core is None else core.full_value(index, "fp32_param")


def safe_get_full_grad(param: torch.nn.Parameter):
    """The parameter's whole gradient in fp32, divided by the fp16 loss scale: what the next
    step will apply (the mean over ranks and micro-steps) once the accumulation boundary's
    backward has run. Stages 0/1: None whenever param.grad is None (after step() or zero_grad());
    before the boundary, this rank's own sum so far. Stages 2/3: the micro-steps reduced so far,
    zeros after step() or zero_grad(). None for a tensor the engine does not hold or a frozen one."""
    core, index = _owner(param)
    if core is None or (core.keeps_full_grads and param.grad is None):
        return None
    return core.full_value(index, "grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    """The parameter's whole optimizer state tensor in fp32 under torch.optim's name: "exp_avg"
    and "exp_avg_sq" (Adam, AdamW), "momentum_buffer" (SGD), "sum" (Adagrad), "exp_avg" (Lion).
    None before the first step creates the state, and for a tensor the engine does not hold or a
    frozen one; an unknown key is a ValueError that lists the optimizer's names."""
    core, index = _owner(param)
    return None if core is None else core.full_value(index, str(optim_state_key))


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"]
