"""``CPUAdam``: Adam / AdamW on CPU fp32 parameters through zeroshard's SIMD kernels, a drop-in
for DeepSpeed's ``DeepSpeedCPUAdam`` (same constructor). Follows ``torch.optim.AdamW``
(adamw_mode=True) or ``torch.optim.Adam`` with L2 weight decay (adamw_mode=False)."""

from __future__ import annotations

import torch

from zeroshard.ops import _cpu_optimizer as base


class CPUAdam(torch.optim.Optimizer):
    """Adam(W) over CPU fp32 parameters.

    Gradients may be float32, bfloat16 or float16; 16-bit gradients take the fused path
    (widen, update and optionally write the 16-bit parameter copy in one pass).
    ``fp32_optimizer_states`` is accepted for DeepSpeed compatibility: state is always fp32.
    """

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        name = type(self).__name__
        base.reject_amsgrad(name, amsgrad)
        base.check_hyper(name, lr, eps, weight_decay, betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=False)
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One step. fp16_param_groups (optional; one list of bf16/fp16 tensors per group, or one
        list for a single group) receives the updated parameters in the same pass."""
        name = type(self).__name__
        loss = base.run_closure(closure)
        targets = base.half_targets(name, fp16_param_groups, self.param_groups)
        for group, g16 in zip(self.param_groups, targets):
            beta1, beta2 = group["betas"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                base.check_param(name, p)
                grad = base.prepare_grad(name, p, allow_half=True)
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                flat = base.FlatParam(p)
                base.kernels.adam_step(
                    flat.flat, grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                    group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                    self.adamw_mode, group["bias_correction"], int(state["step"]),
                    param16=None if g16 is None else g16[i].view(-1))
                flat.close()
        return loss


DeepSpeedCPUAdam = CPUAdam

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]
