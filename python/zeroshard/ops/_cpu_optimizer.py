"""What the CPU optimizers share: argument checks with messages that say what is allowed, and
the tensor preparation that lets the C++ kernels see flat contiguous CPU memory."""

from __future__ import annotations

import torch

from zeroshard import _C

kernels = _C.kernels

_HALF = (torch.bfloat16, torch.float16)


def check_hyper(cls: str, lr, eps=None, weight_decay=0.0, betas=None) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"{cls}: lr: got {lr}, expected >= 0")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"{cls}: eps: got {eps}, expected >= 0")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{cls}: weight_decay: got {weight_decay}, expected >= 0")
    if betas is not None:
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{cls}: betas: got {tuple(betas)}, expected two values in [0, 1)")


def reject_amsgrad(cls: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(f"{cls}: amsgrad=True is not supported; use amsgrad=False, or "
                         "torch.optim.Adam(amsgrad=True)")


def check_param(cls: str, p: torch.Tensor) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"{cls}: parameters must live on the CPU; got one on {p.device}. "
                         "Use a GPU optimizer (torch.optim.AdamW(fused=True)) for device "
                         "parameters, or optimizer offload in the config")
    if p.dtype != torch.float32:
        raise ValueError(f"{cls}: parameters must be float32 (the fp32 master weights); got "
                         f"{p.dtype}. Keep an fp32 copy for the optimizer and pass the "
                         "16-bit model copy through fp16_param_groups")


def prepare_grad(cls: str, p: torch.Tensor, allow_half: bool) -> torch.Tensor:
    g = p.grad
    if g.is_sparse:
        raise ValueError(f"{cls}: sparse gradients are not supported")
    if g.dtype != torch.float32 and not (allow_half and g.dtype in _HALF):
        allowed = "float32, bfloat16 or float16" if allow_half else "float32"
        raise ValueError(f"{cls}: gradient dtype {g.dtype} is not supported; expected {allowed}")
    if g.device.type != "cpu":
        raise ValueError(f"{cls}: gradients must live on the CPU; got one on {g.device}")
    return g.reshape(-1) if g.is_contiguous() else g.contiguous().reshape(-1)


class FlatParam:
    """A flat contiguous fp32 view of a parameter; writes back on close() when the parameter
    itself is not contiguous (the kernel then updates a copy)."""

    def __init__(self, p: torch.Tensor):
        self.p = p
        self.copied = not p.data.is_contiguous()
        self.flat = p.data.contiguous().view(-1) if self.copied else p.data.view(-1)

    def close(self) -> None:
        if self.copied:
            self.p.data.copy_(self.flat.view_as(self.p.data))


def half_targets(cls: str, fp16_param_groups, param_groups):
    """Per-group lists of 16-bit tensors that receive the updated parameters, or None."""
    if fp16_param_groups is None:
        return [None] * len(param_groups)
    groups = fp16_param_groups
    if isinstance(groups, torch.Tensor) or (groups and isinstance(groups[0], torch.Tensor)):
        groups = [groups]
    if len(groups) != len(param_groups):
        raise ValueError(f"{cls}: fp16_param_groups has {len(groups)} groups, the optimizer "
                         f"{len(param_groups)}")
    out = []
    for gi, (g16, group) in enumerate(zip(groups, param_groups)):
        g16 = [g16] if isinstance(g16, torch.Tensor) else list(g16)
        if len(g16) != len(group["params"]):
            raise ValueError(f"{cls}: fp16_param_groups[{gi}] has {len(g16)} tensors, the "
                             f"group {len(group['params'])} parameters")
        for t, p in zip(g16, group["params"]):
            if t.dtype not in _HALF or t.device.type != "cpu" or not t.is_contiguous() \
                    or t.numel() != p.numel():
                raise ValueError(f"{cls}: fp16_param_groups[{gi}] needs contiguous CPU bfloat16 "
                                 f"or float16 tensors shaped like the parameters; got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        out.append(g16)
    return out


def run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
