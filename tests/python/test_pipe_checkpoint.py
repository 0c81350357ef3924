"""Pipeline checkpoints (zeroshard/checkpoint/pipeline.py): a 2 stages x 2 data run (ZeRO 1, fp32
AdamW, a WarmupLR schedule, clipping, the embedding tied to the unembedding across the first and
last stage) saves after 3 steps; a fresh 4 stages x 1 engine loads it and its next 3 losses and
final weights and moments are the saving run's; the same checkpoint loads into the same layers
without a pipeline (ZeRO 3, world 2, the tie one shared Parameter) which trains on the same way
and saves a checkpoint a 2-stage pipeline loads back; and layers that differ are named. An
interleaved run (2 stages x 2 model chunks) resumes bit for bit in its own layout and within
1e-6 with one chunk per rank."""
import json
import os

import numpy as np
import pytest

from harness import run_distributed

MICRO, GAS, BLOCKS = 2, 4, 4
GLOBAL_BATCH = MICRO * GAS * 2  # every run below steps on the same 16 sequences
SAVE_AT, END = 3, 6
TOL = 1e-6


def _config(micro, gas, zero_stage):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}},
            "gradient_clipping": 0.5, "zero_optimization": {"stage": zero_stage}, "steps_per_print": 1000}


def _pipeline(stages, blocks=BLOCKS, base_seed=1234, zero_stage=1, virtual=1):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import layer_specs, loss_fn
    dp = int(os.environ["WORLD_SIZE"]) // stages
    net = PipelineModule(layers=layer_specs(blocks), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         base_seed=base_seed, partition_method="uniform", virtual_stages=virtual)
    gas = GLOBAL_BATCH // (MICRO * dp)
    config = _config(MICRO, gas, zero_stage)
    if virtual > 1:
        config["pipeline"] = {"schedule": "interleaved_1f1b", "virtual_stages": virtual}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    return engine


def plain_layers(blocks=BLOCKS, seed=99):
    """The pipeline's layers in one container named by layer index (pipe_models.IndexedLayers): the
    tied unembedding is the embedding module again."""
    import torch
    from pipe_models import IndexedLayers, layer_specs
    torch.manual_seed(seed)  # unlike the checkpoint's weights, so a missed load shows
    return IndexedLayers(layer_specs(blocks))


def _state(engine):
    """{name: {"fp32", "exp_avg", "exp_avg_sq"}} of every trainable parameter this rank holds
    (full_values is collective at stage 3: every rank calls this at the same point)."""
    core = engine._core
    held = engine._gathered if core.strategy.partitions_params else engine._params
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    for i in range(core.num_params):
        out[names[id(held[i])]] = {k: core.full_values.get(i, "fp32_param" if k == "fp32" else k).cpu().numpy()
                                   for k in ("fp32", "exp_avg", "exp_avg_sq")}
    return out


def _train_pipeline(engine, data):
    from pipe_models import rank_micro_batches
    it = rank_micro_batches(data, MICRO, engine.gradient_accumulation_steps(), engine.grid.get_data_parallel_id())
    return [float(engine.train_batch(it)) for _ in data]


def _train_plain(engine, data):
    """Each rank's contiguous part of every global batch; returns this rank's losses."""
    import torch
    from pipe_models import loss_fn
    rank, world = engine.global_rank, engine.world_size
    part = GLOBAL_BATCH // world
    losses = []
    for x, y in data:
        loss = loss_fn(engine(x[rank * part:(rank + 1) * part]), y[rank * part:(rank + 1) * part])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    mean = torch.tensor(losses)
    torch.distributed.all_reduce(mean)
    return (mean / world).tolist()


def _error_of(engine, path):
    try:
        engine.load_checkpoint(path, tag="ck")
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return None


def pipeline_worker(root):
    """World 4: save from 2 x 2, resume in 4 x 1, and a 4-stage pipeline of other layers."""
    from pipe_models import batches
    data = batches(END, MICRO, GAS, 2, seed=7)
    saver = _pipeline(2)
    before = _train_pipeline(saver, data[:SAVE_AT])
    saver.save_checkpoint(os.path.join(root, "pipe"), tag="ck", client_state={"at": SAVE_AT})
    at_save = _state(saver)
    after = _train_pipeline(saver, data[SAVE_AT:])
    saved = {"losses": before + after, "at_save": at_save, "end": _state(saver), "lr": saver.get_lr()}

    loader = _pipeline(4, base_seed=99)
    path, client = loader.load_checkpoint(os.path.join(root, "pipe"), tag="ck")
    loaded = {"client": client, "state": _state(loader), "steps": loader.global_steps,
              "samples": loader.global_samples, "lr": loader.get_lr()}
    loaded["losses"] = _train_pipeline(loader, data[SAVE_AT:])
    loaded["end"] = _state(loader)
    loaded["end_lr"] = loader.get_lr()
    other_layers = _error_of(_pipeline(4, blocks=BLOCKS + 1), os.path.join(root, "pipe"))
    return {"saved": saved, "loaded": loaded, "other_layers": other_layers}


def plain_worker(root):
    """World 2: the pipeline checkpoint into the plain layers at ZeRO 3, on for 3 steps, saved and
    loaded into a 2-stage pipeline; other plain layers are an error."""
    import zeroshard
    from pipe_models import batches
    data = batches(END, MICRO, GAS, 2, seed=7)

    def plain(blocks=BLOCKS):
        model = plain_layers(blocks)
        engine, _, _, _ = zeroshard.initialize(model=model, config=_config(GLOBAL_BATCH // 2, 1, 3),
                                               model_parameters=model.parameters())
        return engine
    engine = plain()
    engine.load_checkpoint(os.path.join(root, "pipe"), tag="ck")
    out = {"loaded": _state(engine), "steps": engine.global_steps, "lr": engine.get_lr()}
    out["losses"] = _train_plain(engine, data[SAVE_AT:])
    out["end"] = _state(engine)
    engine.save_checkpoint(os.path.join(root, "plain"), tag="ck")
    back = _pipeline(2)
    back.load_checkpoint(os.path.join(root, "plain"), tag="ck")
    out["back"] = _state(back)
    out["back_steps"] = back.global_steps
    out["other_layers"] = _error_of(plain(BLOCKS + 1), os.path.join(root, "pipe"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pipe_ckpt"))
    pipe = run_distributed(pipeline_worker, 4, root, timeout=300)
    plain = run_distributed(plain_worker, 2, root, timeout=300)
    with open(os.path.join(root, "pipe", "ck", "manifest.json")) as f:
        sections = json.load(f)["sections"]
    return pipe, plain, sections


def _joined(per_rank):
    """One {name: state} from every rank's; a name on several ranks (a tie, data-parallel copies)
    must agree exactly."""
    out = {}
    for states in per_rank:
        for name, s in states.items():
            if name in out:
                for k in s:
                    assert np.array_equal(out[name][k], s[k]), f"{name}: {k} differs between ranks"
            out[name] = s
    return out


def _plain_name(name):
    return "0" + name[len("tied_modules.embed"):] if name.startswith("tied_modules.embed.") else name


def _pipe_name(name):
    return "tied_modules.embed" + name[1:] if name.startswith("0.") else name


def _close(got, want, what, kinds=("fp32", "exp_avg", "exp_avg_sq"), tol=TOL):
    assert sorted(got) == sorted(want), f"{what}: names {sorted(set(got) ^ set(want))} differ"
    for name in want:
        for k in kinds:
            a, b = got[name][k].reshape(-1), want[name][k].reshape(-1)
            err, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
            assert err <= tol * scale, f"{what}: {k} of {name} differs by {err:.3e} (scale {scale:.3e})"


def _losses_close(got, want, what):
    for step, (a, b) in enumerate(zip(got, want), SAVE_AT):
        assert abs(a - b) <= TOL * abs(b), f"{what}: step {step} loss {a!r}, the saving run's {b!r}"


def test_the_manifest_describes_every_stage(runs):
    pipe, _, sections = runs
    assert sections["pipeline"] == {"num_stages": 2, "virtual_stages": 1, "num_layers": BLOCKS + 3,
                                    "parts": [0, 4, BLOCKS + 3],
                                    "tied": {"embed": {"attrs": ["weight"], "layers": [0, BLOCKS + 2]}}}
    layout = sections["layout"]
    assert (layout["world_size"], layout["zero_stage"]) == (4, 1)
    # Every stage's parameters once, in the order of the same layers without a pipeline.
    names = [p["name"] for p in layout["params"]]
    want = [_pipe_name(n) for n, _ in plain_layers().named_parameters()]
    assert names == want, names
    assert all(p["trainable"] and p["group"] == 0 for p in layout["params"])


def test_a_pipeline_checkpoint_resumes_in_another_number_of_stages(runs):
    pipe, _, _ = runs
    saved = pipe[0]["saved"]
    at_save = _joined([r["saved"]["at_save"] for r in pipe])
    end = _joined([r["saved"]["end"] for r in pipe])
    assert "tied_modules.embed.weight" in at_save and "5.weight" in at_save, sorted(at_save)
    loaded = _joined([r["loaded"]["state"] for r in pipe])
    _close(loaded, at_save, "4 stages after the load", tol=0.0)  # every element moved unchanged
    for rank, r in enumerate(pipe):
        got = r["loaded"]
        assert got["client"] == {"at": SAVE_AT}, f"rank {rank}: {got['client']}"
        assert (got["steps"], got["samples"]) == (SAVE_AT, SAVE_AT * GLOBAL_BATCH), f"rank {rank}"
        assert got["end_lr"] == saved["lr"], f"rank {rank}: lr {got['end_lr']} vs {saved['lr']}"
        _losses_close(got["losses"], saved["losses"][SAVE_AT:], f"rank {rank}, 4 stages")
    _close(_joined([r["loaded"]["end"] for r in pipe]), end, f"4 stages after {END} steps")


def test_a_pipeline_checkpoint_loads_without_a_pipeline_and_back(runs):
    pipe, plain, _ = runs
    at_save = {_plain_name(n): s for n, s in _joined([r["saved"]["at_save"] for r in pipe]).items()}
    end = _joined([r["saved"]["end"] for r in pipe])
    _close(_joined([r["loaded"] for r in plain]), at_save, "no pipeline after the load", tol=0.0)
    for rank, r in enumerate(plain):
        assert r["steps"] == SAVE_AT and r["back_steps"] == END, f"rank {rank}"
        _losses_close(r["losses"], pipe[0]["saved"]["losses"][SAVE_AT:], f"rank {rank}, no pipeline")
    _close(_joined([r["end"] for r in plain]), {_plain_name(n): s for n, s in end.items()},
           f"no pipeline after {END} steps")
    # ... and its checkpoint back into a 2-stage pipeline: the tie is "0.weight" in it.
    plain_end = _joined([r["end"] for r in plain])
    _close(_joined([r["back"] for r in plain]), {_pipe_name(n): s for n, s in plain_end.items()},
           "2 stages from the plain checkpoint", tol=0.0)


def test_layers_that_differ_are_named(runs):
    """BLOCKS + 1 blocks: layer 5 is a Block where the checkpoint has the final LayerNorm. Every
    rank names what the checkpoint has and no rank's model does; a rank names its own
    parameters that the checkpoint lacks (in a pipeline, the ranks that hold layer 5)."""
    pipe, plain, _ = runs
    for where, errors, holders in (("4 stages", [r["other_layers"] for r in pipe], (2,)),
                                   ("no pipeline", [r["other_layers"] for r in plain], (0, 1))):
        for rank, error in enumerate(errors):
            assert error is not None, f"{where}, rank {rank}: the load succeeded"
            assert error.startswith("ValueError: load_checkpoint: the model's parameters"), f"{where}: {error}"
            assert "not in the model: 5.weight, 5.bias" in error, f"{where}, rank {rank}: {error}"
            assert ("missing from the checkpoint: 5.ln.weight" in error) == (rank in holders), \
                f"{where}, rank {rank}: {error}"


def _own_parts_worker(root):
    """A tied module with a parameter of its own beside the tied weight, and a loss module with a
    buffer, over 2 stages: trains as one process does, saves, and a fresh engine loads it and
    trains on exactly as the saving engine does."""
    import torch
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import Reference, WeightedLoss, batches, biased_specs, rank_micro_batches

    def build(base_seed):
        net = PipelineModule(layers=biased_specs(2), num_stages=2, loss_fn=WeightedLoss(), seed_layers=True,
                             base_seed=base_seed, partition_method="uniform")
        config = _config(MICRO, GAS, 1)
        del config["scheduler"]
        engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                               model_parameters=[p for p in net.parameters() if p.requires_grad])
        return engine

    data = batches(4, MICRO, GAS, 1, seed=3)
    engine = build(1234)
    losses = [float(engine.train_batch(rank_micro_batches(data[i:i + 1], MICRO, GAS, 0))) for i in range(2)]
    ref = Reference(biased_specs(2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    loss_fn = WeightedLoss()
    ref_losses = []
    for x, y in data[:2]:
        opt.zero_grad()
        # The pipeline's loss: the mean of the micro-batches' (a class-weighted loss of the whole
        # batch would weigh its sequences otherwise).
        loss = sum(loss_fn(ref(x[i:i + MICRO]), y[i:i + MICRO]) for i in range(0, len(x), MICRO)) / GAS
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_losses.append(float(loss))
    bias = engine.module.tied_modules["embed"].bias.detach().clone()
    ref_bias = ref.tied["embed"].bias.detach().clone()
    engine.save_checkpoint(os.path.join(root, "own"), tag="t")
    fresh = build(777)
    fresh.load_checkpoint(os.path.join(root, "own"), tag="t")
    loaded_bias = fresh.module.tied_modules["embed"].bias.detach().clone()
    go_on = [float(e.train_batch(rank_micro_batches(data[2:4], MICRO, GAS, 0))) for e in (engine, fresh)]
    return {"losses": losses, "ref_losses": ref_losses, "bias": bias.numpy(), "ref_bias": ref_bias.numpy(),
            "loaded_bias": loaded_bias.numpy(), "go_on": go_on,
            "class_weight": fresh.module.loss_fn.class_weight.numpy()}


def test_a_tied_modules_own_parameter_and_a_loss_module_save_and_load(tmp_path):
    results = run_distributed(_own_parts_worker, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        _losses_close(r["losses"], r["ref_losses"], f"rank {rank}: training against one process")
        # The bias both stages read is one tensor: equal to one process's, on both stages.
        assert np.allclose(r["bias"], r["ref_bias"], rtol=1e-5, atol=1e-7), f"rank {rank}: tied bias"
        assert np.array_equal(r["loaded_bias"], r["bias"]), f"rank {rank}: the loaded bias is not the saved one"
        assert r["go_on"][0] == r["go_on"][1], f"rank {rank}: the loaded engine trains differently: {r['go_on']}"
    assert np.array_equal(results[0]["class_weight"], results[1]["class_weight"])


def _interleaved_worker(root):
    """World 2: 2 stages x 2 model chunks (interleaved_1f1b) save after 3 steps; a fresh engine of
    the same layout and one with one chunk per rank (1f1b, other stage boundaries) load it and
    go on."""
    import json as json_
    from pipe_models import batches
    data = batches(END, MICRO, GAS, 2, seed=7)
    saver = _pipeline(2, virtual=2)
    before = _train_pipeline(saver, data[:SAVE_AT])
    saver.save_checkpoint(os.path.join(root, "v2"), tag="ck")
    after = _train_pipeline(saver, data[SAVE_AT:])
    out = {"losses": before + after, "end": _state(saver)}
    for name, virtual in (("same", 2), ("v1", 1)):
        loader = _pipeline(2, base_seed=99, virtual=virtual)
        loader.load_checkpoint(os.path.join(root, "v2"), tag="ck")
        out[name] = {"losses": _train_pipeline(loader, data[SAVE_AT:]), "end": _state(loader)}
    with open(os.path.join(root, "v2", "ck", "manifest.json")) as f:
        out["section"] = json_.load(f)["sections"]["pipeline"]
    return out


def test_an_interleaved_checkpoint_resumes_exactly_and_in_another_layout(tmp_path):
    results = run_distributed(_interleaved_worker, 2, str(tmp_path), timeout=240)
    section = results[0]["section"]
    assert (section["num_stages"], section["virtual_stages"]) == (2, 2), section
    assert len(section["parts"]) == 2 * 2 + 1, section  # 4 global stages' boundaries
    saved_end = _joined([r["end"] for r in results])
    for rank, r in enumerate(results):
        # The same layout goes on bit for bit as the run that saved.
        assert r["same"]["losses"] == r["losses"][SAVE_AT:], f"rank {rank}: {r['same']['losses']} vs {r['losses']}"
        _losses_close(r["v1"]["losses"], r["losses"][SAVE_AT:], f"rank {rank}, virtual_stages 1")
    _close(_joined([r["same"]["end"] for r in results]), saved_end, "virtual_stages 2 reloaded", tol=0.0)
    _close(_joined([r["v1"]["end"] for r in results]), saved_end, "virtual_stages 1 from virtual_stages 2")


def _grouped(named):
    """Two param groups: the tied embedding's (lr 1e-3) and the rest."""
    is_tied = [n.startswith(("tied_modules.", "0.")) for n, _ in named]
    return [{"params": [p for (_, p), t in zip(named, is_tied) if t], "lr": 1e-3},
            {"params": [p for (_, p), t in zip(named, is_tied) if not t]}]


def _grouped_worker(root, mode):
    """mode "save": 3 stages, so the middle one's optimizer has only the second group (numbered 0
    there), trained one step and saved; "load": the same layers without a pipeline, same groups."""
    import torch
    import zeroshard
    from pipe_models import SEQ, VOCAB, IndexedLayers, layer_specs, loss_fn
    from zeroshard.pipe import PipelineModule
    config = {k: v for k, v in _config(2, 1, 1).items() if k != "scheduler"}  # the groups' own lrs
    if mode == "save":
        net = PipelineModule(layers=layer_specs(4), num_stages=3, loss_fn=loss_fn, partition_method="uniform")
        engine, _, _, _ = zeroshard.initialize(model=net, config=config, model_parameters=_grouped(
            list(net.named_parameters())))
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        engine.train_batch(iter([(x, x)]))
        engine.save_checkpoint(root, tag="g")
        return None
    model = IndexedLayers(layer_specs(4))
    engine, _, _, _ = zeroshard.initialize(model=model, config=config,
                                           model_parameters=_grouped(list(model.named_parameters())))
    engine.load_checkpoint(root, tag="g")
    return [g["lr"] for g in engine.optimizer.param_groups]


def test_a_pipeline_whose_stage_lacks_a_group_loads_without_a_pipeline(tmp_path):
    """A pipeline's stages number their own param groups (an empty one left out), so the group of
    each parameter is not compared across such a load; the groups' hyper-parameters come through."""
    run_distributed(_grouped_worker, 3, str(tmp_path), "save")
    assert run_distributed(_grouped_worker, 1, str(tmp_path), "load")[0] == [1e-3, pytest.approx(1e-2)]
