"""Pipeline errors, from the script's side: a stage that raises ends every rank with an error
naming that stage and micro-batch (no hang); a boundary shape that changes between micro-batches
is named with both shapes; ZeRO stage 2 with a pipeline, a config that disagrees with the module,
forward/backward/step on a pipeline engine and bad partitions are clear errors; a layer that
cannot be built on the meta device stops only the partition that needs its count."""
import re
import time

import pytest

from harness import run_distributed

MICRO, GAS = 2, 4


def _engine(stages, gas=GAS, extra=None, layers=None, **module_kwargs):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import layer_specs, loss_fn
    net = PipelineModule(layers=layers or layer_specs(2, tied=False), num_stages=stages, loss_fn=loss_fn,
                         seed_layers=True, **module_kwargs)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    config.update(extra or {})
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    return engine


def _raising_stage(fail_layer, fail_call, fail_rank, evaluating=False):
    import torch
    import torch.distributed as dist
    from pipe_models import batches, layer_specs, rank_micro_batches
    from zeroshard.pipe import LayerSpec

    class Fails(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Fails.calls += 1
            if Fails.calls - 1 == fail_call and dist.get_rank() == fail_rank:
                raise ValueError("the layer's own error")
            return x

    layers = layer_specs(2, tied=False)
    layers.insert(fail_layer, LayerSpec(Fails))
    engine = _engine(2, layers=layers, partition_method="uniform")
    dp = engine.dp_world_size
    it = rank_micro_batches(batches(2, MICRO, GAS, dp), MICRO, GAS, engine.global_rank % dp)
    t0 = time.monotonic()
    try:
        if evaluating:
            engine.eval_batch(it)
        else:
            engine.train_batch(it)
            engine.train_batch(it)
    except BaseException as error:  # noqa: BLE001 - the message goes back to the test
        notes = "\n".join(getattr(error, "__notes__", []))
        return {"type": type(error).__name__, "text": f"{error}\n{notes}", "seconds": time.monotonic() - t0}
    return {"type": None, "text": "", "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("fail_layer,stage,world", [(5, 1, 2), (1, 0, 2), (1, 0, 4)],
                         ids=["last_stage", "first_stage", "first_stage_2x2"])
def test_a_stage_that_raises_ends_every_rank_naming_it(fail_layer, stage, world):
    # layers: Embed, Block, Block, FinalNorm, Linear + Fails at fail_layer: 6 layers, 3 per stage.
    # At 2 stages x 2 data, only data index 0 of the stage raises: its replica finishes the list
    # and meets the failure in the data-parallel reduction, a sub-group collective.
    dp = world // 2
    fail_rank = stage * dp
    results = run_distributed(_raising_stage, world, fail_layer, 2, fail_rank, timeout=120,
                              env={"ZEROSHARD_TIMEOUT": "1"})
    raiser = results[fail_rank]
    assert raiser["type"] == "ValueError", raiser
    assert "the layer's own error" in raiser["text"]
    assert f"pipeline stage {stage} forward of micro-batch 2" in raiser["text"], raiser["text"]
    for rank, other in enumerate(results):
        if rank == fail_rank:
            continue
        assert other["type"] == "CommError", (rank, other)
        # Every other rank's error names the failing stage and micro-batch, also when the failing
        # rank is rank 0, whose process holds the store (its report is read before it exits), and
        # the other rank is blocked in a point-to-point wait (the watcher ends it) or a
        # data-parallel collective; never a hang: well within the collective timeout (60 s here).
        assert other["seconds"] < 30, (rank, other)
        assert f"pipeline stage {stage} forward of micro-batch 2" in other["text"], (rank, other["text"])
        # ... and what went wrong there, so that rank 0's log alone says it.
        assert "raised ValueError: the layer's own error" in other["text"], (rank, other["text"])


@pytest.mark.parametrize("fail_layer,stage,call,world", [(5, 1, 2, 2), (1, 0, 2, 2), (5, 1, GAS - 1, 2),
                                                        (5, 1, GAS - 1, 4)],
                         ids=["last_stage", "first_stage", "last_micro_batch", "last_micro_batch_2x2"])
def test_an_eval_forward_that_raises_ends_every_rank_naming_it(fail_layer, stage, call, world):
    # At the last micro-batch, stage 0 has sent everything and waits in the eval loss's reduction
    # (a pipe-group collective, whose communicator has no store); at 2 x 2 the other last-stage
    # replica waits in the data-parallel reduction of the eval output.
    dp = world // 2
    fail_rank = stage * dp
    results = run_distributed(_raising_stage, world, fail_layer, call, fail_rank, True, timeout=120,
                              env={"ZEROSHARD_TIMEOUT": "1"})
    named = f"pipeline stage {stage} forward (eval) of micro-batch {call} raised ValueError: the layer's own error"
    raiser = results[fail_rank]
    assert raiser["type"] == "ValueError" and "the layer's own error" in raiser["text"], raiser
    assert named in raiser["text"], raiser["text"]
    for rank, other in enumerate(results):
        if rank == fail_rank:
            continue
        assert other["type"] == "CommError", (rank, other)
        assert other["seconds"] < 30, (rank, other)
        assert named in other["text"], (rank, other["text"])


def _raising_backward(schedule, virtual):
    import torch
    from pipe_models import D_MODEL, batches, layer_specs, rank_micro_batches
    from zeroshard.pipe import LayerSpec

    class FailsBackward(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            FailsBackward.calls += 1
            if FailsBackward.calls == 2:
                raise ValueError("the layer's own backward error")
            return grad

    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(D_MODEL))

        def forward(self, x):
            return FailsBackward.apply(x * self.scale)

    layers = layer_specs(2, tied=False)
    layers.insert(2, LayerSpec(Fails))  # on stage 0: the backward error waits for stage 1's gradient
    extra = {"pipeline": {"schedule": schedule, "virtual_stages": virtual}}
    engine = _engine(2, layers=layers, partition_method="uniform", virtual_stages=virtual, extra=extra)
    it = rank_micro_batches(batches(1, MICRO, GAS, 1), MICRO, GAS, 0)
    t0 = time.monotonic()
    try:
        engine.train_batch(it)
    except BaseException as error:  # noqa: BLE001
        notes = "\n".join(getattr(error, "__notes__", []))
        return {"type": type(error).__name__, "text": f"{error}\n{notes}", "seconds": time.monotonic() - t0}
    return {"type": None, "text": "", "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)])
def test_a_backward_that_raises_ends_every_rank_naming_it(schedule, virtual):
    results = run_distributed(_raising_backward, 2, schedule, virtual, timeout=120, env={"ZEROSHARD_TIMEOUT": "1"})
    raisers = [r for r in results if r["type"] == "ValueError"]
    assert len(raisers) == 1, results
    raiser, other = raisers[0], results[1 - results.index(raisers[0])]
    assert "the layer's own backward error" in raiser["text"], raiser
    named = re.search(r"pipeline stage \d+ backward(_input|_weight)? of micro-batch \d+", raiser["text"])
    assert named, raiser["text"]
    assert other["type"] == "CommError", other
    assert named.group(0) in other["text"], other["text"]
    assert "raised ValueError: the layer's own backward error" in other["text"], other["text"]
    assert other["seconds"] < 30, other


def _changing_shape(evaluating):
    from pipe_models import batches, rank_micro_batches
    engine = _engine(2)
    data = list(rank_micro_batches(batches(1, MICRO, GAS, 1), MICRO, GAS, 0))
    x, y = data[2]
    data[2] = (x[:, :-1], y[:, :-1])  # micro-batch 2 is one token shorter
    try:
        if evaluating:  # as evaluating at another sequence length than training's, unannounced
            engine.eval_batch(iter(data))
        else:
            engine.train_batch(iter(data))
    except BaseException as error:  # noqa: BLE001
        return {"type": type(error).__name__, "text": str(error) + "\n".join(getattr(error, "__notes__", []))}
    return {"type": None}


@pytest.mark.parametrize("evaluating", [False, True], ids=["train_batch", "eval_batch"])
def test_a_boundary_shape_that_changes_is_named(evaluating):
    results = run_distributed(_changing_shape, 2, evaluating, timeout=120, env={"ZEROSHARD_TIMEOUT": "1"})
    sender = results[0]
    assert sender["type"] == "ValueError", sender
    assert "output of stage 0 for micro-batch 2 is (float32[2, 7, 16])" in sender["text"], sender["text"]
    assert "micro-batch 0 agreed (float32[2, 8, 16])" in sender["text"], sender["text"]
    assert results[1]["type"] == "CommError", results[1]
    assert "stage 0" in results[1]["text"] and "micro-batch 2" in results[1]["text"], results[1]["text"]
    assert "raised ValueError: pipeline: the output of stage 0 for micro-batch 2" in results[1]["text"], results[1]["text"]


def _config_errors():
    from zeroshard.pipe import PipelineError, PipelineModule
    from pipe_models import layer_specs
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as error:  # noqa: BLE001
            out[name] = f"{type(error).__name__}: {error}"

    attempt("stage2", lambda: _engine(1, extra={"zero_optimization": {"stage": 2}}))
    attempt("stages_key", lambda: _engine(1, extra={"pipeline": {"stages": 2}}))
    attempt("virtual_key", lambda: _engine(1, extra={"pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}))
    attempt("virtual_module", lambda: _engine(2, virtual_stages=2))
    attempt("schedule_value", lambda: _engine(1, extra={"pipeline": {"schedule": "looped_bfs"}}))
    attempt("partition", lambda: PipelineModule(layer_specs(2), num_stages=1, partition_method="profile"))
    attempt("regex", lambda: PipelineModule(layer_specs(2), num_stages=1, partition_method="type:attention"))
    attempt("too_few_layers", lambda: PipelineModule(layer_specs(0)[:3], num_stages=2, virtual_stages=2))
    attempt("not_dividing", lambda: PipelineModule(layer_specs(2), num_stages=3))
    attempt("interleave_gas", lambda: _engine(2, gas=3, virtual_stages=2,
                                              extra={"pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}))
    # pipeline/schedule.cpp owns the one-stage rule; the engine asks it and keeps its key.
    attempt("one_stage_virtual", lambda: _engine(1, virtual_stages=2,
                                                 extra={"pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}))
    # One chunk per rank is 1F1B's order: any number of micro-batches, as Megatron-LM.
    attempt("interleave_one_chunk", lambda: _engine(2, gas=3, extra={"pipeline": {"schedule": "interleaved_1f1b"}}))
    attempt("partition_key", lambda: _engine(1, extra={"pipeline": {"partition": "uniform"}}))
    attempt("dynamic_shape", lambda: PipelineModule(layer_specs(2), num_stages=1, dynamic_shape="false"))
    # A constructor that cannot run on the meta device: only "parameters" needs its count.
    import logging
    import torch
    from zeroshard.pipe import LayerSpec

    class MetaHostile(torch.nn.Linear):
        def __init__(self, d):
            super().__init__(d, d)
            self.scale = float(self.weight.detach().abs().max())  # reads a value: fails on meta

    printed = []
    handler = logging.Handler()
    handler.emit = lambda record: printed.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    hostile = layer_specs(1) + [LayerSpec(MetaHostile, 48)]
    attempt("meta_uniform", lambda: PipelineModule(hostile, num_stages=1, partition_method="uniform"))
    logging.getLogger("zeroshard").removeHandler(handler)
    out["meta_print"] = "\n".join(m for m in printed if "pipeline partition" in m)
    attempt("meta_parameters", lambda: PipelineModule(hostile, num_stages=1))
    engine = _engine(1)
    for name in ("forward", "backward", "step"):
        try:
            getattr(engine, name)(None)
            out[name] = None
        except PipelineError as error:
            out[name] = str(error)
    return out


def test_configuration_errors_name_the_key():
    out = run_distributed(_config_errors, 2, timeout=120)[0]
    assert "zero_optimization.stage: got 2 with a PipelineModule" in out["stage2"]
    assert "pipeline.stages: got 2, the PipelineModule has 1 stages" in out["stages_key"]
    assert "pipeline.virtual_stages: got 2, the PipelineModule was built with virtual_stages=1" in out["virtual_key"]
    assert "pipeline.virtual_stages: got 1, the PipelineModule was built with virtual_stages=2" in out["virtual_module"]
    assert "pipeline.schedule: got \"looped_bfs\", expected one of" in out["schedule_value"]
    assert "partition_method 'profile', expected 'parameters', 'uniform' or 'type:<regex>'" in out["partition"]
    assert "matches no layer; the layers' types are" in out["regex"]
    assert "3 layers cannot fill 4 stages" in out["too_few_layers"]
    assert "num_stages 3 must divide the world size 2" in out["not_dividing"]
    assert "gradient_accumulation_steps: got 3" in out["interleave_gas"], out["interleave_gas"]
    assert "expected a multiple of num_stages (2) for schedule interleaved_1f1b" in out["interleave_gas"], out["interleave_gas"]
    assert out["one_stage_virtual"].startswith("ValueError: pipeline.virtual_stages: got 2 with num_stages 1, "
                                               "expected 1 for schedule interleaved_1f1b"), out["one_stage_virtual"]
    assert out["interleave_one_chunk"] is None, out["interleave_one_chunk"]
    assert out["meta_uniform"] is None, out["meta_uniform"]
    assert "'MetaHostile'] ? parameters" in out["meta_print"], out["meta_print"]  # printed, count unknown
    assert ("partition_method 'parameters' counts each layer's parameters by building it on the meta device; "
            "layer 4 (MetaHostile) failed there") in out["meta_parameters"], out["meta_parameters"]
    assert "pipeline.partition: got 'uniform', but the PipelineModule was built with partition_method='parameters'" in out["partition_key"]
    assert "PipelineModule: dynamic_shape 'false', expected True or False" in out["dynamic_shape"], out["dynamic_shape"]
    for name in ("forward", "backward", "step"):
        assert out[name] and "Only train_batch() and eval_batch()" in out[name]


def _deepspeed_style_data():
    """DeepSpeedExamples' pipeline script: initialize(training_data=dataset), then train_batch()
    with no iterator; and a last layer that returns the loss itself (loss_fn=None)."""
    import torch
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import VOCAB, SEQ, layer_specs, loss_fn

    class Dataset(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            return t[:-1], t[1:]

    net = PipelineModule(layers=layer_specs(2, tied=False), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    net_loss = PipelineModule(layers=layer_specs(2, tied=False) + [lambda logits: logits.float().square().mean()],
                              num_stages=2, loss_fn=None, seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    engine, _, loader, _ = zeroshard.initialize(model=net_loss, config=config, training_data=Dataset(),
                                                model_parameters=[p for p in net_loss.parameters() if p.requires_grad])
    losses = [float(engine.train_batch()) for _ in range(3)]
    # A stored iterator: train_batch(it) once, then train_batch() reads on from it.
    engine2, _, _, _ = zeroshard.initialize(model=net, config=config,
                                            model_parameters=[p for p in net.parameters() if p.requires_grad])
    it = iter([(torch.zeros(MICRO, SEQ, dtype=torch.long), torch.zeros(MICRO, SEQ, dtype=torch.long))] * 4)
    try:
        engine2.train_batch(it)
        engine2.train_batch()
        read_on = "ok"
    except Exception as error:  # noqa: BLE001
        read_on = f"{type(error).__name__}: {error}"
    return {"losses": losses, "steps": engine.global_steps, "loader": loader is not None, "read_on": read_on}


def test_training_data_and_a_layer_that_returns_the_loss():
    results = run_distributed(_deepspeed_style_data, 2, timeout=120)
    for r in results:
        assert r["steps"] == 3 and r["loader"]
        assert all(l == l and l > 0 for l in r["losses"]), r["losses"]
        assert r["losses"] == results[0]["losses"]  # every rank returns the same mean loss
        assert r["read_on"] == "ok", r["read_on"]


def test_an_int16_boundary_tensor_on_nccl_is_named_before_any_transfer():
    import torch
    from zeroshard.pipe.p2p import StageLinks

    class NcclComm:  # what StageLinks reads of an NCCL communicator; no transfer may start
        backend = "nccl"

        def __getattr__(self, name):
            raise AssertionError(f"{name} called: the error must come before any transfer")

    links = StageLinks(NcclComm(), torch.device("cpu"))
    with pytest.raises(TypeError, match=r"stage 0 outputs an int16 tensor, which NCCL cannot send; make it int32"):
        links.send((torch.zeros(2, 3, dtype=torch.int16),), "activation", 1, 0, peer=1)
