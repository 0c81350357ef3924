"""DeepSpeed's deepspeed.utils helpers that read or write a whole parameter's state when ZeRO keeps
only a shard of it on each rank: its fp32 master values, its gradient and its optimizer state.
A getter assembles the tensor from every rank's shard (one all-reduce of the parameter's size
where the state is sharded); a setter broadcasts rank 0's value and each rank keeps its part. So
every rank must call them, in the same order. Also the few general helpers DeepSpeed scripts
import from deepspeed.utils and deepspeed.runtime.utils: RepeatingLoader (zeroshard.dataloader's),
set_random_seed and see_memory_usage."""
import torch

from zeroshard.dataloader import RepeatingLoader  # deepspeed.utils.RepeatingLoader
from zeroshard.log import logger  # deepspeed.utils.logger, whose level Hugging Face's Trainer sets
from zeroshard.zero.partition_init import partitioned_before_engine


def _owner(param):
    core = getattr(param, "_zeroshard_core", None)
    if partitioned_before_engine(param):
        # Partitioned by zero.Init: only a chunk exists until an engine takes it.
        raise ValueError(f"zeroshard.utils: parameter ds_id {param.ds_id} (shape "
                         f"{tuple(param.ds_shape)}) was partitioned by zero.Init and no engine "
                         "holds it yet; call zeroshard.initialize() first, or read it inside "
                         "zeroshard.zero.GatheredParameters")
    return (core, param._zeroshard_index) if core is not None else (None, None)


def safe_get_full_fp32_param(param: torch.nn.Parameter):
    """The parameter's whole fp32 value (the master copy under bf16/fp16), or None for a tensor
    the engine does not hold (not a parameter of its module, or frozen below stage 3)."""
    core, index = _owner(param)
    return None if core is None else core.full_values.get(index, "fp32_param")


def safe_get_full_grad(param: torch.nn.Parameter):
    """The parameter's whole gradient in fp32, divided by the fp16 loss scale: what the next
    step will apply (the mean over ranks and micro-steps) once the accumulation boundary's
    backward has run; None before a backward and after step() or zero_grad(). Before the
    boundary, stages 0/1 give this rank's own sum so far (None whenever param.grad is None),
    stages 2/3 the micro-steps reduced so far. None for a tensor the engine does not hold or a
    frozen one."""
    core, index = _owner(param)
    if core is None or (core.strategy.keeps_full_grads and param.grad is None):
        return None
    return core.full_values.get(index, "grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    """The parameter's whole optimizer state tensor in fp32 under torch.optim's name: "exp_avg"
    and "exp_avg_sq" (Adam, AdamW), "momentum_buffer" (SGD), "sum" (Adagrad), "exp_avg" (Lion).
    None before the first step creates the state, and for a tensor the engine does not hold or a
    frozen one; an unknown key is a ValueError that lists the optimizer's names."""
    core, index = _owner(param)
    return None if core is None else core.full_values.get(index, str(optim_state_key))


def _held(param, caller):
    core, index = _owner(param)
    if core is None:
        raise ValueError(f"{caller}: the tensor (shape {tuple(param.shape)}) is not a parameter "
                         "the engine trains: not in its model, or frozen below stage 3, where it "
                         "is an ordinary tensor to copy into")
    return core, index


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor):
    """Makes `value` (the parameter's shape, any floating dtype) the parameter's fp32 master value
    and its model-dtype value, on every rank: rank 0's value is broadcast, so the replicas stay
    equal. Takes effect at once, also in a parameter ZeRO-3 holds gathered."""
    core, index = _held(param, "safe_set_full_fp32_param")
    core.full_values.set(index, "fp32_param", value)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                  optim_state_key: str):
    """Makes `value` (the parameter's shape) the optimizer state `optim_state_key` (torch.optim's
    name, as in safe_get_full_optimizer_state) of the parameter on every rank, from rank 0. Before
    the first step this creates the state, which the first step then continues from."""
    core, index = _held(param, "safe_set_full_optimizer_state")
    core.full_values.set(index, str(optim_state_key), value)


def set_z3_leaf_modules(model, leaf_module_classes):
    """DeepSpeed's ZeRO-3 leaf modules (a Mixture-of-Experts layer gathered as one unit): not
    supported by zeroshard, whose stage 3 gathers each module's own parameters as it runs."""
    raise NotImplementedError(
        "set_z3_leaf_modules: ZeRO-3 leaf modules (DeepSpeed's Mixture-of-Experts support) are "
        "not supported by zeroshard; leave the MoE layer classes unset (accelerate: "
        "transformer_moe_cls_names / ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES)")


def see_memory_usage(message, force=False):
    """DeepSpeed's deepspeed.runtime.utils.see_memory_usage (Megatron-DeepSpeed calls it): with
    force, rank 0 logs the message, the memory the accelerator counts now and at its peak (CUDA:
    torch's allocated bytes; CPU: this process's resident bytes) and the host's used memory, then
    starts the peak again. Without force it does nothing, as DeepSpeed's."""
    import gc

    import torch.distributed as dist

    from zeroshard.accelerator import get_accelerator
    from zeroshard.launcher.check_agent import memory as host_memory
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    acc, gib = get_accelerator(), 1024 ** 3
    host = host_memory()
    used = host["mem_total_bytes"] - host["mem_available_bytes"]
    logger.info(f"{message}\nMA {acc.memory_allocated() / gib:.2f} GB Max_MA {acc.max_memory_allocated() / gib:.2f} GB"
                f"\nCPU Virtual Memory: used = {used / gib:.2f} GB, "
                f"percent = {100 * used / max(host['mem_total_bytes'], 1):.1f}%")
    acc.reset_peak_memory_stats()


def set_random_seed(seed):
    """DeepSpeed's deepspeed.runtime.utils.set_random_seed: seeds Python's, NumPy's and torch's
    generators with `seed`."""
    import random

    import numpy
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["logger", "RepeatingLoader", "see_memory_usage", "set_random_seed", "set_z3_leaf_modules",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state"]
