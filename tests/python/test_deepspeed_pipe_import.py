"""A checkpoint that DeepSpeed 0.19.8's PipelineEngine saved (tests/fixtures/deepspeed_pipe/, made
by make_fixture.py there: pipe_models' layers with the embedding tied to the unembedding, 2 stages,
ZeRO 0, 3 steps of train_batch) loads with load_checkpoint the way a DeepSpeed script calls it:
into the same layers as a zeroshard pipeline of 2 stages and of 1, and without a pipeline. Each gets
DeepSpeed's weights exactly, the loss DeepSpeed's eval_batch gave on a fixed batch after the save,
its step counters, LR schedule and client_state. Its optimizer state is not read, and a load
that asks for it is refused before anything is written."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "deepspeed_pipe")
sys.path.insert(0, FIXTURE)
import make_fixture as made  # noqa: E402 - the fixture's model, batches and settings

EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))
CKPT = os.path.join(FIXTURE, "ckpt")
RTOL = 1e-5


def _expected_weights():
    """DeepSpeed's module state_dicts of both stages, in PipelineModule's names (the tie on both)."""
    weights = {}
    for stage in range(EXPECTED["stages"]):
        weights.update(load_file(os.path.join(FIXTURE, f"expected_stage{stage}.safetensors")))
    return weights


def _config():
    config = made.config()
    config["steps_per_print"] = 10 ** 6
    return config


def _pipeline_rank(stages, **load_kwargs):
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from pipe_models import loss_fn, rank_micro_batches
    torch.manual_seed(99)  # unlike the checkpoint's weights, so a missed load shows
    net = PipelineModule(layers=made.layers(LayerSpec, TiedLayerSpec), num_stages=stages, loss_fn=loss_fn)
    engine, _, _, _ = zeroshard.initialize(model=net, config=_config(),
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        path, client = engine.load_checkpoint(CKPT, **load_kwargs)
    except ValueError as error:
        unchanged = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
        return {"error": str(error), "unchanged": unchanged}
    loss = engine.eval_batch(rank_micro_batches(made.eval_batch(), made.MICRO, made.GAS, 0))
    return {"path": path, "client": client, "loss": float(loss), "steps": engine.global_steps,
            "samples": engine.global_samples, "lr": engine.get_lr(),
            "scheduler": engine.lr_scheduler.state_dict(),
            "weights": _numpy(engine.module.named_parameters())}


def _numpy(named):
    """Tensors leave a rank's process as numpy arrays (by value)."""
    return {n: p.detach().numpy().copy() for n, p in named}


def _check_loaded(result, weights):
    assert result["path"] == os.path.join(CKPT, "step3")
    assert result["client"] == EXPECTED["client_state"]
    assert result["steps"] == EXPECTED["global_steps"] and result["samples"] == EXPECTED["global_samples"]
    assert result["scheduler"]["last_batch_iteration"] == EXPECTED["lr_scheduler"]["last_batch_iteration"]
    assert result["loss"] == pytest.approx(EXPECTED["eval_loss"], rel=RTOL)
    for name, value in result["weights"].items():
        assert torch.equal(torch.from_numpy(value), weights[name]), name


@pytest.mark.parametrize("stages", [2, 1])
def test_a_deepspeed_pipeline_checkpoint_loads_into_a_pipeline(stages):
    results = run_distributed(_pipeline_rank, stages, stages, load_optimizer_states=False, timeout=120)
    weights = _expected_weights()
    held = set()
    for result in results:
        _check_loaded(result, weights)
        held |= set(result["weights"])
    assert held == set(weights), sorted(set(weights) ^ held)
    assert "tied_modules.embed.weight" in held


def test_load_module_only_reads_the_weights_and_nothing_else():
    result, = run_distributed(_pipeline_rank, 1, 1, load_module_only=True, timeout=120)
    assert result["steps"] == 0
    assert result["loss"] == pytest.approx(EXPECTED["eval_loss"], rel=RTOL)


def test_asking_for_its_optimizer_state_is_refused_before_anything_is_written():
    results = run_distributed(_pipeline_rank, 2, 2, timeout=120)  # load_optimizer_states defaults to True
    for result in results:
        assert "optimizer state zeroshard does not read" in result["error"], result["error"]
        assert "load_optimizer_states=False" in result["error"]
        assert result["unchanged"]


def _plain_rank():
    """The same layers in one container named by layer index, without a pipeline (ZeRO 0, one rank)."""
    import zeroshard
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    from pipe_models import loss_fn
    from test_pipe_checkpoint import plain_layers

    model = plain_layers(made.BLOCKS)
    specs = made.layers(LayerSpec, TiedLayerSpec)
    assert [type(m).__name__ for _, m in model.named_children()] == [s.typename.__name__ for s in specs][:-1]
    config = _config()
    config["gradient_accumulation_steps"] = 1
    config["train_micro_batch_size_per_gpu"] = made.MICRO * made.GAS
    engine, _, _, _ = zeroshard.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.load_checkpoint(CKPT, load_optimizer_states=False)
    (x, y), = made.eval_batch()
    with torch.no_grad():
        loss = float(loss_fn(engine(x), y))
    return {"loss": loss, "steps": engine.global_steps,
            "weights": _numpy(engine.module.named_parameters())}


def test_a_deepspeed_pipeline_checkpoint_loads_without_a_pipeline():
    result, = run_distributed(_plain_rank, 1, timeout=120)
    weights = _expected_weights()
    assert result["steps"] == EXPECTED["global_steps"]
    assert result["loss"] == pytest.approx(EXPECTED["eval_loss"], rel=RTOL)
    tied = {"0.weight": "tied_modules.embed.weight"}
    for name, value in result["weights"].items():
        assert torch.equal(torch.from_numpy(value), weights[tied.get(name, name)]), name


def test_the_reader_names_what_it_cannot_read(tmp_path):
    from zeroshard.checkpoint_import.deepspeed_pipe import DeepSpeedPipelineCheckpoint
    ckpt = DeepSpeedPipelineCheckpoint(os.path.join(CKPT, "step3"))
    assert (ckpt.num_stages, ckpt.data_parallel_size, ckpt.zero_stage, ckpt.dtype) == (2, 1, 0, "fp32")
    assert ckpt.optimizer_saved
    assert ckpt.names[0] == "0.weight" and "4.weight" not in ckpt.names  # a tie's forward_fn use has no file
    (tmp_path / "layer_00-model_01-model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="tensor parallelism"):
        DeepSpeedPipelineCheckpoint(str(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    for name in os.listdir(os.path.join(CKPT, "step3")):
        if name != "mp_rank_01_model_states.pt":
            (other / name).write_bytes(open(os.path.join(CKPT, "step3", name), "rb").read())
    with pytest.raises(FileNotFoundError, match="mp_world_size is 2"):
        DeepSpeedPipelineCheckpoint(str(other))
