"""engine.no_sync(): DDP's and DeepSpeed's block whose backwards accumulate this rank's gradients
without reducing them, at stages 0 and 1; refused at stages 2 and 3."""
import copy
import os

import pytest
import torch

from harness import run_distributed
from test_engine import _base_config


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(model, rank, step, micro):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
    return (model(x) ** 2).mean()


def no_sync_worker(stage, synced_micro_steps):
    import torch.distributed as dist

    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = _model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    cfg = _base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}},
                       gradient_accumulation_steps=synced_micro_steps,
                       zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    for step in range(2):
        ref_opt.zero_grad()
        with engine.no_sync():
            for micro in range(2):
                engine.backward(_loss(engine, rank, step, micro))
                (_loss(reference, rank, step, micro) / synced_micro_steps).backward()
                # Not reduced: each rank holds the sum of its own micro-batches' gradients, which
                # differ between ranks.
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{name}, in no_sync: {m}")
            with pytest.raises(RuntimeError, match="inside engine.no_sync"):
                engine.step()
            with pytest.raises(RuntimeError, match="do not nest"):
                with engine.no_sync():
                    pass
        for micro in range(2, 2 + synced_micro_steps):
            engine.backward(_loss(engine, rank, step, micro))
            (_loss(reference, rank, step, micro) / synced_micro_steps).backward()
            engine.step()
        with torch.no_grad():
            for q in reference.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
        ref_opt.step()
        # The boundary backward reduced everything accumulated since the last step: the same
        # update as one backward over all micro-batches of all ranks.
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}, step {step}: {m}")


@pytest.mark.parametrize("stage,synced_micro_steps", [(0, 1), (1, 2)])
def test_no_sync_accumulates_locally_and_the_next_boundary_reduces_the_sum(stage,
                                                                            synced_micro_steps):
    run_distributed(no_sync_worker, 2, stage, synced_micro_steps)


def refused_worker(stage):
    import zeroshard
    engine, *_ = zeroshard.initialize(model=_model(),
                                      config=_base_config(zero_optimization={"stage": stage}))
    with pytest.raises(RuntimeError, match=f"ZeRO stage {stage} keeps only this rank's shard"):
        with engine.no_sync():
            pass
    engine.backward(_loss(engine, 0, 0, 0))  # the engine is still usable
    engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_where_gradients_are_sharded(stage):
    run_distributed(refused_worker, 1, stage)
