"""``CPUAdagrad``: Adagrad on CPU fp32 parameters through zeroshard's SIMD kernels, a drop-in for
DeepSpeed's ``DeepSpeedCPUAdagrad`` (same constructor); follows ``torch.optim.Adagrad``."""

from __future__ import annotations

import torch

from zeroshard.ops import _cpu_optimizer as base


class CPUAdagrad(torch.optim.Optimizer):
    """Adagrad over CPU fp32 parameters (torch.optim.Adagrad with lr_decay=0 and
    initial_accumulator_value=0). Gradients in bf16/fp16 are widened first."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True):
        name = type(self).__name__
        base.reject_amsgrad(name, amsgrad)
        base.check_hyper(name, lr, eps, weight_decay)
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                            amsgrad=False))
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        name = type(self).__name__
        loss = base.run_closure(closure)
        targets = base.half_targets(name, fp16_param_groups, self.param_groups)
        for group, g16 in zip(self.param_groups, targets):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                base.check_param(name, p)
                grad = base.prepare_grad(name, p, allow_half=True).float()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["sum"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                flat = base.FlatParam(p)
                base.kernels.adagrad_step(
                    flat.flat, grad, state["sum"].view(-1), group["lr"], 0.0, group["eps"],
                    group["weight_decay"], int(state["step"]),
                    param16=None if g16 is None else g16[i].view(-1))
                flat.close()
        return loss


DeepSpeedCPUAdagrad = CPUAdagrad

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]
