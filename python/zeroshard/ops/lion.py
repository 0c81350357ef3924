"""``CPULion``: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on CPU
fp32 parameters through zeroshard's SIMD kernels, a drop-in for DeepSpeed's ``DeepSpeedCPULion``
(same constructor)."""

from __future__ import annotations

import torch

from zeroshard.ops import _cpu_optimizer as base


class CPULion(torch.optim.Optimizer):
    """Lion: p <- p*(1 - lr*wd) - lr*sign(beta1*m + (1-beta1)*g); m <- beta2*m + (1-beta2)*g."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
                 fp32_optimizer_states=True):
        name = type(self).__name__
        base.check_hyper(name, lr, None, weight_decay, betas)
        super().__init__(model_params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        name = type(self).__name__
        loss = base.run_closure(closure)
        targets = base.half_targets(name, fp16_param_groups, self.param_groups)
        for group, g16 in zip(self.param_groups, targets):
            beta1, beta2 = group["betas"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                base.check_param(name, p)
                grad = base.prepare_grad(name, p, allow_half=True).float()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                flat = base.FlatParam(p)
                base.kernels.lion_step(
                    flat.flat, grad, state["exp_avg"].view(-1), group["lr"], beta1, beta2,
                    group["weight_decay"], param16=None if g16 is None else g16[i].view(-1))
                flat.close()
        return loss


DeepSpeedCPULion = CPULion

__all__ = ["CPULion", "DeepSpeedCPULion"]
