"""The CUDA fused Adam (kernels/cuda/optimizers.cu through _C.kernels.adam_step on CUDA tensors)
against torch.optim.AdamW(fused=True) and the CPU kernels. Skips without a GPU."""

import pytest
import torch

from zeroshard import _C

K = _C.kernels
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("n", [1, 1000, 65537, 1 << 20])
def test_cuda_adam_matches_torch_fused_and_cpu(adamw, n):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(10)]
    lr, wd = 1e-2, 0.05

    ref = torch.nn.Parameter(p0.cuda())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, weight_decay=wd, fused=True)
    ours, m, v = p0.cuda(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    cpu, cm, cv = p0.clone(), torch.zeros(n), torch.zeros(n)
    p16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for step, gr in enumerate(grads, start=1):
        ref.grad = gr.cuda()
        opt.step()
        K.adam_step(ours, gr.cuda(), m, v, lr, 0.9, 0.999, 1e-8, wd, adamw, True, step, param16=p16)
        K.adam_step(cpu, gr, cm, cv, lr, 0.9, 0.999, 1e-8, wd, adamw, True, step)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.cpu(), cpu, rtol=1e-6, atol=1e-6)
    assert torch.equal(p16, ours.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_grad_stats(dtype):
    g = torch.randn(1 << 20, device="cuda").to(dtype)
    s, finite = K.grad_stats(g)
    assert finite and s == pytest.approx(g.double().square().sum().item(), rel=1e-9)
    g[7] = float("nan")
    assert K.grad_stats(g)[1] is False


def test_cuda_fused_16bit_gradients_with_unscale():
    n = 100_003
    p0, gr = torch.randn(n), torch.randn(n).to(torch.bfloat16)
    ours, m, v = p0.cuda(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    cpu, cm, cv = p0.clone(), torch.zeros(n), torch.zeros(n)
    K.adam_step(ours, gr.cuda(), m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, grad_scale=0.125)
    K.adam_step(cpu, gr, cm, cv, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, grad_scale=0.125)
    torch.testing.assert_close(ours.cpu(), cpu, rtol=1e-6, atol=1e-6)
