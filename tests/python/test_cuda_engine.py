"""The numerics contract on a GPU: the engine on CUDA tensors with NCCL (a world of one, the GPU
machine has one GPU) against torch.optim on the same GPU, at every ZeRO stage, for every optimizer
kind (the CUDA fused Adam, and the ATen paths of the others, Lamb's trust ratio included), fp32
and bf16. The same worker as test_zero_parity.py; it runs on whatever device the engine picks.
Skips without a GPU (the CPU path of every case runs in test_zero_parity.py)."""
import pytest
import torch

from harness import run_distributed
from test_zero_parity import ADAMW, LAMB, STEPS, VARIANTS, parity_worker

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_gpt_parity(stage, precision):
    run_distributed(parity_worker, 1, "gpt", stage, precision, 2, ADAMW, 0.0, 700, STEPS)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"prescale", "predivide"}))
def test_cuda_variant_parity(name, stage):
    model_name, optimizer, clip, extra = VARIANTS[name]
    run_distributed(parity_worker, 1, model_name, stage, "fp32", 2, optimizer, clip, 500, STEPS, extra)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_lamb_parity(stage):
    run_distributed(parity_worker, 1, "gpt", stage, "fp32", 2, LAMB, 0.0, 500, STEPS)


@pytest.mark.parametrize("stage", [1, 2])
def test_cuda_fp16_parity(stage):
    run_distributed(parity_worker, 1, "gpt", stage, "fp16", 1, ADAMW, 0.0, 2000, STEPS)
