"""Gradient buckets and their staging (zero/staged_reducer.*, zero/buckets.*): each bucket reduced
once per backward, the staging cap, a parameter larger than a bucket reduced in pieces, stage 3
reducing in the staging buffers themselves; and, at every stage, where the reduction's factors
round with a narrower communication dtype."""
import copy
import os

import pytest
import torch

from harness import run_distributed
from models import global_batch, tiny_gpt
from test_engine import _base_config

def collectives_per_backward_worker(stage, overlap_comm):
    import zeroshard
    # Stage 3 with DeepSpeed's default reuse distance keeps this small model gathered from its
    # forward to its backward, so from the second step on backward issues no gathers at all.
    cfg = _base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 1000,
                                          "overlap_comm": overlap_comm,
                                          "stage3_param_persistence_threshold": 0})
    engine, *_ = zeroshard.initialize(model=tiny_gpt(), config=cfg)
    counts = []
    for step in range(3):
        loss = engine(global_batch("gpt", step, 2))
        before = engine._comm.sequence
        engine.backward(loss)
        counts.append(engine._comm.sequence - before)
        engine.step()
    return counts, engine._core.num_buckets


@pytest.mark.parametrize("stage,overlap_comm", [(2, False), (2, True), (3, True), (3, False)])
def test_each_gradient_bucket_is_reduced_once_per_backward(stage, overlap_comm):
    # A bucket finished during backward used to be reduced a second time (with zeros) by the
    # end-of-backward sweep: right sums, twice the communication.
    counts, buckets = run_distributed(collectives_per_backward_worker, 2, stage, overlap_comm)[0]
    assert counts[1:] == [buckets] * 2, (counts, buckets)


def staging_cap_worker(stage, overlap_comm):
    import zeroshard
    torch.manual_seed(0)
    # Eight 1024x1024 layers (1.05M elements each) and DeepSpeed's default reduce_bucket_size (5e8):
    # the staging cap decides the buckets.
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cfg = _base_config(zero_optimization={"stage": stage, "overlap_comm": overlap_comm})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    engine.step()
    return engine._core.num_buckets, engine._core.memory.peak_bytes()["comm_buffers"]


@pytest.mark.parametrize("stage", [2, 3])
def test_staging_holds_at_most_8m_elements_with_or_without_overlap(stage):
    # Buckets fill from the last parameter backwards. Without overlap_comm one buffer of buckets up
    # to 8M elements: seven layers and the next layer's bias, then the rest. With it two buffers of
    # buckets up to 4M: three layers and a bias, then two more buckets. Either way at most 8M fp32
    # elements of staging.
    layer = 1024 * 1024 + 1024
    for overlap, expect in [(False, (2, (7 * layer + 1024) * 4)), (True, (3, 2 * (3 * layer + 1024) * 4))]:
        buckets, staged = run_distributed(staging_cap_worker, 2, stage, overlap)[0]
        assert (buckets, staged) == expect, (overlap, buckets, staged)
        assert staged <= 8_000_000 * 4


class _BigEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(1000, 23)  # 23000 elements: more than one bucket
        self.head = torch.nn.Linear(23, 1)

    def forward(self, ids):
        return self.head(self.embed(ids)).square().mean()


def big_parameter_worker(stage, overlap_comm):
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = _BigEmbedding()
    reference = copy.deepcopy(model)
    cfg = _base_config(optimizer={"type": "SGD", "params": {"lr": 0.5}}, gradient_accumulation_steps=2,
                       zero_optimization={"stage": stage, "overlap_comm": overlap_comm,
                                          "reduce_bucket_size": 5000,
                                          "stage3_param_persistence_threshold": 0})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        batches = [torch.randint(0, 1000, (2 * world, 64), generator=g) for _ in range(2)]
        for ids in batches:
            engine.backward(engine(ids[2 * rank:2 * rank + 2]))
            engine.step()
        ref_opt.zero_grad()
        for ids in batches:
            for r in range(world):
                (reference(ids[2 * r:2 * r + 2]) / (2 * world)).backward()
        ref_opt.step()
    with GatheredParameters(list(model.parameters())):
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= 1e-5 * scale, f"rank {rank}: {name} off by {err:.3e} (scale {scale:.3e})"
    return engine._core.num_buckets, engine._core.memory.peak_bytes()["comm_buffers"]


@pytest.mark.parametrize("stage,overlap_comm,world", [(2, True, 2), (2, False, 3), (3, True, 3), (3, False, 2)])
def test_a_parameter_larger_than_a_bucket_is_reduced_in_pieces(stage, overlap_comm, world):
    # The 23000-element embedding is reduced in pieces of at most reduce_bucket_size (5000)
    # staged elements, so the staging pool holds buckets of that size instead of the whole
    # embedding twice: stage 2 pieces of 5000 of its elements, stage 3 pieces of 5000 // world of
    # each rank's chunk (23000 / 3 does not divide: the last rank's chunk is one shorter).
    buckets, staged = run_distributed(big_parameter_worker, world, stage, overlap_comm)[0]
    piece = 5000 if stage == 2 else 5000 // world * world
    chunk = 23000 if stage == 2 else -(-23000 // world)
    pieces = -(-chunk // (5000 if stage == 2 else 5000 // world))
    assert buckets == pieces + 1, buckets                     # and one bucket for the head
    assert staged == (2 if overlap_comm else 1) * piece * 4, staged


def zero3_comm_buffer_worker(gas):
    import zeroshard
    torch.manual_seed(0)
    # A plain stack: gradients arrive in bucket order, so the staging pool stays at its two
    # buffers (overlap_comm) and the accounting below is exact.
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)])
    cfg = _base_config(bf16={"enabled": True}, gradient_accumulation_steps=gas,
                       zero_optimization={"stage": 3, "reduce_bucket_size": 1200,
                                          "stage3_param_persistence_threshold": 0})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    for step in range(2 * gas):
        x = torch.randn(2, 24, generator=torch.Generator().manual_seed(step))
        engine.backward((engine(x.to(torch.bfloat16)) ** 2).mean())
        engine.step()
    return engine._core.memory.peak_bytes()["comm_buffers"]


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_reduces_in_the_staging_buffers_with_or_without_accumulation(world):
    # Each bucket is reduce-scattered in place in its staging buffer and this rank's part is copied
    # (or, when a window accumulates, added) into its gradient shard, so the gradient staging is
    # the staging pool alone: two buffers (overlap_comm) of the largest bucket, two 24x24 layers
    # with biases (1200 bf16 elements), at any world size.
    staging = run_distributed(zero3_comm_buffer_worker, world, 1)[0]
    accumulating = run_distributed(zero3_comm_buffer_worker, world, 2)[0]
    assert staging == accumulating == 2 * 1200 * 2, (staging, accumulating)


def comm_dtype_rounding_worker(stage):
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import safe_get_full_grad
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    reference = copy.deepcopy(model)
    # gradient_predivide_factor 3 at world 2: 1/3 before the sum (in the communication dtype,
    # where the sum happens) and 3/2 after it. A bf16 value times 1.5 needs one more mantissa bit
    # than bf16 has, but is exact in fp32.
    cfg = _base_config(communication_data_type="bf16", gradient_predivide_factor=3.0,
                       zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
    engine.backward(engine(x).pow(2).mean())
    reference(x).pow(2).mean().backward()
    for name, p in reference.named_parameters():
        got = safe_get_full_grad(dict(model.named_parameters())[name])
        if dist.get_world_size() == 1:  # nothing communicated: no bf16 copy, no factor
            assert torch.equal(got, p.grad), (name, (got - p.grad).abs().max())
            continue
        summed = p.grad.to(torch.bfloat16).mul_(1 / 3)
        dist.all_reduce(summed)  # two terms: the same sum in any order
        expect = summed.float() * 1.5  # rounded once, in fp32
        assert torch.equal(got, expect), (name, (got - expect).abs().max())


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_narrower_comm_dtype_is_scaled_after_the_sum_in_the_gradients_dtype(stage, world):
    run_distributed(comm_dtype_rounding_worker, world, stage)


def unrounded_factors_worker(stage):
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import safe_get_full_grad
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    f = 10 / 3  # neither 1/f nor f/world is exact in bf16
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    cfg = _base_config(bf16={"enabled": True}, gradient_accumulation_steps=2,
                       gradient_predivide_factor=f, zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    grads = []
    for micro in range(2):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * micro + rank))
        x = x.to(torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        if micro == 0:
            engine.step()  # a micro-step: the second backward is the boundary
        reference.zero_grad()
        (reference(x).float().pow(2).mean() / 2).backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})

    def reduced(g):  # 1/f before the sum, in bf16; two terms: the same sum in any order
        g = g.mul(1 / f)
        dist.all_reduce(g)
        return g.float()

    post = f / world
    for name, p in model.named_parameters():
        g1, g2 = grads[0][name], grads[1][name]
        if world == 1:  # nothing summed, so no factor: the two micro-steps' bf16 sum, unscaled
            expect = g1 + g2
        elif engine.zero_optimization_stage() < 2:  # the window's sum, reduced at the boundary
            expect = (reduced(g1 + g2) * post).to(torch.bfloat16)
        else:  # each micro-step reduced and added into the bf16 shard, in fp32
            shard = (reduced(g1) * post).to(torch.bfloat16)
            expect = (reduced(g2) * post + shard.float()).to(torch.bfloat16)
        got = safe_get_full_grad(p)
        assert torch.equal(got, expect.float()), (name, (got - expect.float()).abs().max())


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_factors_that_bf16_cannot_hold_apply_unrounded_to_bf16_gradients(stage, world):
    # ATen's in-place mul_ and add_'s alpha round the factor to bf16 first: 0.3 would be applied
    # as 0.30078 and 5/3 as 1.664. A single rank applies no factor at all.
    run_distributed(unrounded_factors_worker, world, stage)
