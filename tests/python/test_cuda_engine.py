"""The numerics contract on a GPU: the engine on CUDA tensors with NCCL (a world of one, the GPU
machine has one GPU) against torch.optim on the same GPU, at every ZeRO stage, for every optimizer
kind (the CUDA fused Adam, and the ATen paths of the others, Lamb's trust ratio included), fp32
and bf16. The same worker as test_zero_parity.py; it runs on whatever device the engine picks.
Also the pipeline engine at one stage (test_pipe_parity.py's run), and exact checkpoint resumes.
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


def _resume_worker(stage, precision, ckdir, mode):
    """12 steps straight ("full"), or 6 then save ("first"), or load then 6 ("second"); returns the
    losses and every fp32 parameter (numpy, for the queue)."""
    import zeroshard
    from models import global_batch, tiny_gpt

    model = tiny_gpt()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    start, steps = (6, 6) if mode == "second" else (0, 12 if mode == "full" else 6)
    if mode == "second":
        _, client = engine.load_checkpoint(ckdir)
        assert client == {"epoch": 6}
    losses = []
    for step in range(start, start + steps):
        loss = engine(global_batch("gpt", step, 2).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if mode == "first":
        engine.save_checkpoint(ckdir, client_state={"epoch": 6})
    values = engine._core.full_values
    return losses, [values.get(i, "fp32_param").cpu().numpy() for i in range(engine._core.num_params)]


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp16"), (2, "bf16"), (3, "bf16")])
def test_cuda_checkpoint_exact_resume(stage, precision, tmp_path):
    """save_checkpoint from CUDA tensors (copied to the host in pieces) and load_checkpoint into
    them: 6 + 6 steps equal 12 bit for bit."""
    full = run_distributed(_resume_worker, 1, stage, precision, str(tmp_path), "full")[0]
    first = run_distributed(_resume_worker, 1, stage, precision, str(tmp_path), "first")[0]
    second = run_distributed(_resume_worker, 1, stage, precision, str(tmp_path), "second")[0]
    assert first[0] + second[0] == full[0]
    for a, b in zip(second[1], full[1]):
        assert (a == b).all()


def test_cuda_one_stage_pipeline_parity():
    """The pipeline engine on a GPU with NCCL set up (a world of one, so one stage and no
    point-to-point transfers): gpipe, 1f1b and zero bubble with ZeRO 0/1, clipping, activation
    checkpointing and eval_batch, against torch.optim.AdamW on the same GPU (test_pipe_parity.py's
    run; its CPU twin runs there)."""
    from test_pipe_parity import _cases, _check
    results = run_distributed(_cases, 1, 1, True, timeout=240)[0]
    assert sorted(results) == ["1f1b", "gpipe", "zero_bubble"]
    for schedule, r in results.items():
        assert r["device"].startswith("cuda") and r["backend"] == "nccl", f"{schedule}: {r['device']}, {r['backend']}"
        _check(f"cuda {schedule}", r)
