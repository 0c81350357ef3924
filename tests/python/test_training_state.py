"""The run's progress as one object (runtime/training_state.h) seen through the engine: DeepSpeed's
counters and the loss scale are read from it, and its state_dict restores all of them at once."""
import os

import pytest

from harness import run_distributed
from models import global_batch, tiny_gpt


def state_worker():
    import zeroshard
    rank = int(os.environ["RANK"])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2},
           # A scale so large that the first steps overflow: skipped steps and a moving scale.
           "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}}
    engine, *_ = zeroshard.initialize(model=tiny_gpt(), config=cfg)
    seen = []
    for micro in range(12):
        engine.backward(engine(global_batch("gpt", micro, 4)[2 * rank:2 * rank + 2]))
        engine.step()
        seen.append((engine.global_steps, engine.micro_steps, engine.global_samples,
                     engine.skipped_steps, engine.get_loss_scale()))
        if micro == 5:
            saved = engine._core.state.state_dict()
    assert seen[-1][:3] == (6, 12, 6 * 8)  # 6 boundaries of 2 micro-steps over 2 ranks x 2
    assert seen[-1][3] > 0 and seen[-1][4] < 2.0 ** 40
    assert saved["global_steps"] == 3 and saved["group_steps"] == [3 - seen[5][3]]
    engine._core.state.load_state_dict(saved)
    assert (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps,
            engine.get_loss_scale()) == seen[5]
    with pytest.raises(ValueError, match="training state: loss_scaler is missing"):
        engine._core.state.load_state_dict({k: v for k, v in saved.items() if k != "loss_scaler"})
    assert engine._core.state.state_dict() == saved  # a refused load changes nothing


def test_counters_and_loss_scale_come_from_one_state_that_round_trips():
    run_distributed(state_worker, 2)
