"""zeroshard.ops CPU optimizers against torch.optim (and a Python Lion reference): 10 steps on
parameters of awkward sizes, 1e-6 relative, on every CPU ISA available here."""

import copy

import pytest
import torch

from zeroshard import _C
from zeroshard.ops.adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from zeroshard.ops.adam import CPUAdam, DeepSpeedCPUAdam
from zeroshard.ops.lion import CPULion, DeepSpeedCPULion

K = _C.kernels
ISAS = [i for i in ("scalar", "avx2", "avx512") if K.cpu_isa_supported(i)]
SHAPES = [(1,), (7,), (3, 5), (17,), (129, 257), (1000, 333)]   # last: 333k elements
STEPS = 10


@pytest.fixture(params=ISAS)
def isa(request):
    before = K.cpu_isa()
    K.set_cpu_isa(request.param)
    yield request.param
    K.set_cpu_isa(before)


def lion_reference(params, lr, betas, weight_decay):
    """Lion as in the paper's pseudo-code, in torch ops, for the comparison."""
    state = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step():
        for p, m in zip(params, state):
            update = (m * betas[0] + p.grad * (1 - betas[0])).sign_()
            p.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
            m.mul_(betas[1]).add_(p.grad, alpha=1 - betas[1])
    return step


# name -> (build ours, build the reference step); both get the same parameters and gradients.
CASES = {
    "adamw": (lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.05),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, foreach=False).step),
    "adam_l2": (lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.05, adamw_mode=False),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, foreach=False).step),
    "adamw_betas": (lambda ps: DeepSpeedCPUAdam(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6),
                    lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6,
                                                 weight_decay=0, foreach=False).step),
    "adagrad": (lambda ps: CPUAdagrad(ps, lr=0.1, weight_decay=0.02),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.02, foreach=False).step),
    "lion": (lambda ps: CPULion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
             lambda ps: lion_reference(ps, 1e-3, (0.9, 0.99), 0.1)),
}


def set_grad(p, grad):
    if grad.dtype != p.dtype:
        p.grad_dtype = None   # torch >= 2.9 pins a gradient's dtype to the parameter's unless told
    p.grad = grad


def make_params(seed, transpose=False):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g) for s in SHAPES]
    if transpose:   # non-contiguous parameters
        ps = [p.t() if p.dim() == 2 else p for p in ps]
    return [torch.nn.Parameter(p) for p in ps]


def run_pair(case, grad_dtype=torch.float32, transpose=False):
    ours_p, ref_p = make_params(0, transpose), make_params(0, transpose)
    ours, ref_step = CASES[case][0](ours_p), CASES[case][1](ref_p)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for a, b in zip(ours_p, ref_p):
            grad = torch.randn(a.shape, generator=g).to(grad_dtype)
            set_grad(a, grad)
            b.grad = grad.float()   # the reference sees the same (rounded) values in fp32
        ours.step()
        ref_step()
    return ours_p, ref_p


def assert_close(ours_p, ref_p, rtol=1e-6):
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_after_10_steps(isa, case):
    assert_close(*run_pair(case))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_adam_with_16bit_gradients_takes_the_fused_path(isa, grad_dtype):
    assert_close(*run_pair("adamw", grad_dtype))


def test_non_contiguous_parameters():
    assert_close(*run_pair("adamw", transpose=True))
    assert_close(*run_pair("lion", transpose=True))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [CPUAdam, CPUAdagrad, CPULion])
def test_16bit_parameter_copy_written_in_the_same_pass(cls, half):
    ps = make_params(3)
    copies = [torch.empty(p.shape, dtype=half) for p in ps]
    opt = cls(ps)
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step(fp16_param_groups=[copies])
    for p, c in zip(ps, copies):
        assert torch.equal(c, p.detach().to(half))   # round to nearest even, as torch


def test_state_dict_round_trip_continues_identically():
    a_p, b_p = make_params(5), make_params(5)
    a = CPUAdam(a_p, lr=1e-2)
    for p in a_p:
        p.grad = torch.ones(p.shape)
    a.step()
    b = CPUAdam(b_p, lr=1e-2)
    with torch.no_grad():
        for x, y in zip(a_p, b_p):
            y.copy_(x)
            y.grad = torch.ones(y.shape)
    b.load_state_dict(copy.deepcopy(a.state_dict()))   # as if saved and loaded
    a.step()
    b.step()
    for x, y in zip(a_p, b_p):
        assert torch.equal(x, y)


def test_aliases_and_signatures():
    assert DeepSpeedCPUAdam is CPUAdam and DeepSpeedCPUAdagrad is CPUAdagrad
    assert DeepSpeedCPULion is CPULion
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = DeepSpeedCPUAdam(p, 1e-3, True, (0.9, 0.999), 1e-8, 0, False, True)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.adamw_mode
    assert CPUAdagrad(p).defaults["lr"] == 1e-2 and CPUAdagrad(p).defaults["eps"] == 1e-10
    assert CPULion(p).defaults["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("make", [
    lambda p: CPUAdam(p, amsgrad=True),
    lambda p: CPUAdagrad(p, amsgrad=True),
])
def test_amsgrad_is_rejected(make):
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        make([torch.nn.Parameter(torch.zeros(3))])


def test_bad_params_are_rejected_clearly():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be float32"):
        CPUAdam([p]).step()
    q = torch.nn.Parameter(torch.zeros(4))
    set_grad(q, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="gradient dtype torch.float64"):
        CPUAdam([q]).step()
    with pytest.raises(ValueError, match="lr: got -1"):
        CPUAdam([q], lr=-1)


def test_grad_stats_one_read(isa):
    g = torch.randn(100_003)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        s, finite = K.grad_stats(g.to(dt))
        assert finite
        assert s == pytest.approx(g.to(dt).double().square().sum().item(), rel=1e-12)
    bad = g.to(torch.float16)
    bad[-1] = float("inf")
    assert K.grad_stats(bad)[1] is False


def test_dispatcher_reports_best_isa():
    assert K.best_cpu_isa() == ISAS[-1]
    with pytest.raises(ValueError, match="expected one of scalar, avx2, avx512"):
        K.set_cpu_isa("sse9")
