"""Parameter groups across a checkpoint (zeroshard/checkpoint/groups.py), written as DeepSpeed scripts
build them: a group list made from the model's named_parameters on every rank, so in a pipeline a
stage can hold none of a group's parameters (embedding and head groups), and a group can be all
frozen (a LoRA-style no_decay group).

- A 2-stage pipeline whose stages hold groups [embedding, blocks] and [blocks, head] (the same count
  on each, so numbering each stage's own groups would give stage 1's blocks the embedding's lr), and
  a fourth group empty on every stage (removed, as without a pipeline): it resumes bit for bit,
  every group's lr and the client LambdaLR where they were, and the checkpoint loads into the same
  layers without a pipeline and goes on as the pipeline did.
- A 3-stage pipeline whose middle stage holds one of the groups resumes in its own layout; where the
  script passes each stage only its non-empty groups (so the stages pass different lists), a
  warning says so at start, and its checkpoint loads the weights but refuses the optimizer state.
  A client optimizer built from named_parameters (torch's "param_names", which differ by stage)
  is numbered alike. SequentialLR's inner schedulers are placed group by group.
- An all-frozen group stays in engine.optimizer.param_groups, its lr scheduled, and one with no
  parameters at all is removed, both as in DeepSpeed; a checkpoint of it resumes, and so does one
  written before groups were numbered so (the frozen group left out)."""
import json
import os

import pytest

from harness import run_distributed

MICRO, GAS, STEPS, SAVE_AT = 2, 2, 4, 2
LRS = (1e-3, 1e-2, 3e-3)  # embedding, blocks, head


def _groups(named, filtered=False):
    """Layer 0 (the embedding), layers 1-4 (the blocks), layers 5-6 (final norm and head), and one
    with no parameters (Hugging Face's no_decay group when every trainable tensor decays);
    `filtered`: only the groups with parameters on this stage, as some scripts pass them."""
    which = [0 if n.startswith("0.") else 1 if int(n.split(".", 1)[0]) <= 4 else 2 for n, _ in named]
    groups = [{"params": [p for (_, p), w in zip(named, which) if w == g], "lr": lr,
               "weight_decay": 0.1 * g} for g, lr in enumerate(LRS)] + [{"params": [], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] if filtered else groups


def _config(micro, gas):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1}, "steps_per_print": 1000}


def _schedule(optimizer):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def _pipeline(stages, seed, filtered=False):
    import zeroshard
    from pipe_models import layer_specs, loss_fn
    from zeroshard.pipe import PipelineModule
    net = PipelineModule(layers=layer_specs(4, tied=False), num_stages=stages, loss_fn=loss_fn,
                         seed_layers=True, base_seed=seed, partition_method="uniform")
    engine, optimizer, _, scheduler = zeroshard.initialize(
        model=net, config=_config(MICRO, GAS), lr_scheduler=_schedule,
        model_parameters=_groups(list(net.named_parameters()), filtered))
    return engine, scheduler


def _held(engine):
    """How many parameters of each group this rank holds."""
    return [len(g["params"]) for g in engine.optimizer.param_groups]


def pipeline_worker(root, stages, mode, filtered=False):
    """mode "save": STEPS steps, saved after SAVE_AT; "resume": a fresh engine (other weights)
    loads and runs the rest; "refused": the load's error, then the weights alone."""
    from pipe_models import batches, rank_micro_batches
    data = batches(STEPS, MICRO, GAS, 1, seed=3)
    engine, scheduler = _pipeline(stages, 1234 if mode == "save" else 99, filtered)
    if mode == "refused":
        try:
            engine.load_checkpoint(root, tag="g")
            return None
        except Exception as e:  # noqa: BLE001 - the test reads it
            error = str(e)
        engine.load_checkpoint(root, tag="g", load_optimizer_states=False)
        engine.train_batch(rank_micro_batches([data[SAVE_AT]], MICRO, GAS, 0))  # the scheduler steps
        return {"error": error, "steps": engine.global_steps, "lr": engine.get_lr()}
    out = {"held": _held(engine), "losses": [], "lrs": []}
    if mode == "save":
        for step in range(STEPS):
            if step == SAVE_AT:
                engine.save_checkpoint(root, tag="g")
                out["lr_at_save"] = engine.get_lr()
            out["losses"].append(float(engine.train_batch(rank_micro_batches([data[step]], MICRO, GAS, 0))))
            out["lrs"].append(engine.get_lr())
    else:
        engine.load_checkpoint(root, tag="g")
        out["lr_at_save"] = engine.get_lr()
        out["scheduler_step"] = scheduler.last_epoch
        for step in range(SAVE_AT, STEPS):
            out["losses"].append(float(engine.train_batch(rank_micro_batches([data[step]], MICRO, GAS, 0))))
    out["lr_at_end"] = engine.get_lr()
    return out


def plain_worker(root):
    """The pipeline's checkpoint into the same layers without a pipeline, one process."""
    import torch
    import zeroshard
    from pipe_models import IndexedLayers, batches, layer_specs, loss_fn
    torch.manual_seed(5)
    model = IndexedLayers(layer_specs(4, tied=False))
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(MICRO * GAS, 1),
                                           model_parameters=_groups(list(model.named_parameters())),
                                           lr_scheduler=_schedule)
    engine.load_checkpoint(root, tag="g")
    out = {"lr_at_save": engine.get_lr(), "losses": []}
    for x, y in batches(STEPS, MICRO, GAS, 1, seed=3)[SAVE_AT:]:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss.detach()))
    return out


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("groups2"))
    saved = run_distributed(pipeline_worker, 2, root, 2, "save", timeout=240)
    resumed = run_distributed(pipeline_worker, 2, root, 2, "resume", timeout=240)
    return root, saved, resumed


def test_stages_holding_different_groups_resume_exactly(two_stages):
    _, saved, resumed = two_stages
    assert [r["held"] for r in saved] == [[1, 18, 0], [0, 6, 3]], "the layout this test is about"
    assert [r["held"] for r in resumed] == [[1, 18, 0], [0, 6, 3]]
    for rank, (s, r) in enumerate(zip(saved, resumed)):
        assert r["lr_at_save"] == s["lr_at_save"], f"rank {rank}: each group's lr as saved"
        assert r["scheduler_step"] == SAVE_AT, f"rank {rank}: the LambdaLR's step"
        assert r["losses"] == s["losses"][SAVE_AT:], f"rank {rank}: {r['losses']} vs {s['losses']}"
        assert r["lr_at_end"] == s["lr_at_end"], f"rank {rank}"
    assert saved[0]["lr_at_save"] == pytest.approx([lr / (1 + SAVE_AT) for lr in LRS], rel=1e-12)


def test_the_pipelines_groups_load_without_a_pipeline(two_stages):
    root, saved, _ = two_stages
    plain = run_distributed(plain_worker, 1, root, timeout=120)[0]
    assert plain["lr_at_save"] == saved[0]["lr_at_save"]
    for got, want in zip(plain["losses"], saved[0]["losses"][SAVE_AT:]):
        assert abs(got - want) <= 1e-5 * abs(want), f"{plain['losses']} vs {saved[0]['losses']}"


def test_a_stage_holding_one_of_two_groups_resumes_in_its_own_layout(tmp_path):
    """3 stages: layers [0, 1, 2], [3, 4], [5, 6] hold groups {0, 1}, {1}, {2}."""
    saved = run_distributed(pipeline_worker, 3, str(tmp_path), 3, "save", timeout=240)
    resumed = run_distributed(pipeline_worker, 3, str(tmp_path), 3, "resume", timeout=240)
    assert [r["held"] for r in saved] == [[1, 12, 0], [0, 12, 0], [0, 0, 3]], "the layout this test is about"
    for rank, (s, r) in enumerate(zip(saved, resumed)):
        assert r["lr_at_save"] == s["lr_at_save"], f"rank {rank}"
        assert r["losses"] == s["losses"][SAVE_AT:], f"rank {rank}: {r['losses']} vs {s['losses']}"


def frozen_group_worker(root, mode):
    """A client AdamW and a LambdaLR (as Hugging Face's schedulers are) over three groups: the frozen
    LayerNorm (a group that stays, with nothing to train, as DeepSpeed's engine keeps it), the
    trainable layers, and one with no parameters at all (which DeepSpeed's engine removes), as Hugging
    Face's Trainer passes its no_decay group when every trainable tensor decays (LoRA)."""
    import torch
    import zeroshard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model[1].requires_grad_(False)
    seed = 0 if mode == "save" else 1
    torch.manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    decay_names = [n for n, _ in model.named_parameters() if not n.startswith("1.")]
    decay = [p for n, p in model.named_parameters() if n in decay_names]
    frozen = [p for n, p in model.named_parameters() if n.startswith("1.")]
    no_decay = [p for n, p in model.named_parameters() if n not in decay_names and p.requires_grad]
    client = torch.optim.AdamW([{"params": frozen, "weight_decay": 0.0, "lr": 5e-3},
                                {"params": decay, "weight_decay": 0.1},
                                {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    engine, optimizer, _, scheduler = zeroshard.initialize(
        model=model, optimizer=client, config={"train_batch_size": 4, "zero_optimization": {"stage": 2}},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step))
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    out = {"groups": [len(gr["params"]) for gr in optimizer.param_groups], "client_groups": len(client.param_groups),
           "losses": []}
    if mode == "load":
        engine.load_checkpoint(root)
        out["lr_at_load"] = engine.get_lr()
        data = data[2:]
    for step, (x, y) in enumerate(data):
        if mode == "save" and step == 2:
            engine.save_checkpoint(root)
            out["lr_at_save"] = engine.get_lr()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss.detach()))
    out["lr_at_end"] = [gr["lr"] for gr in optimizer.param_groups]
    return out


def _as_before_groups_were_numbered_as_passed(root):
    """Rewrites the checkpoint as the code before this one wrote it: without the marker, the frozen
    group (the first) left out of param_groups, group_steps and the scheduler's per-group lists, and
    the parameters numbered among the groups left."""
    with open(os.path.join(root, "latest")) as f:
        path = os.path.join(root, f.read().strip(), "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    sections = manifest["sections"]
    assert sections["layout"]["optimizer"].pop("every_param_group") is True
    sections["param_groups"] = sections["param_groups"][1:]
    sections["training_state"]["group_steps"] = sections["training_state"]["group_steps"][1:]
    for p in sections["layout"]["params"]:
        p["group"] = None if p["group"] is None else p["group"] - 1
    for key, value in sections["lr_scheduler"].items():
        if isinstance(value, list) and len(value) == 2:
            sections["lr_scheduler"][key] = value[1:]
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_an_all_frozen_group_stays_and_resumes(tmp_path):
    saved = run_distributed(frozen_group_worker, 1, str(tmp_path), "save")[0]
    assert saved["groups"] == [0, 4] and saved["client_groups"] == 3
    assert saved["lr_at_save"] == [5e-3 / 4, 1e-2 / 4], "the scheduler drives both groups"
    loaded = run_distributed(frozen_group_worker, 1, str(tmp_path), "load")[0]
    assert loaded["lr_at_load"] == saved["lr_at_save"]
    assert loaded["losses"] == saved["losses"][2:]
    assert loaded["lr_at_end"] == saved["lr_at_end"]
    _as_before_groups_were_numbered_as_passed(str(tmp_path))
    older = run_distributed(frozen_group_worker, 1, str(tmp_path), "load")[0]
    assert older["lr_at_load"][1] == saved["lr_at_save"][1]
    assert older["losses"] == saved["losses"][2:]
    assert older["lr_at_end"][1] == saved["lr_at_end"][1]


@pytest.mark.parametrize("stages, held", [(3, [[1, 12], [12], [3]]), (2, [[1, 18], [6, 3]])])
def test_stages_passing_different_lists_of_groups_load_the_weights_only(tmp_path, capfd, stages, held):
    """Each stage passed only its own non-empty groups: 2, 1 and 1 of them at 3 stages; at 2, two
    each, [embedding, blocks] and [blocks, head]. The weights load, and so does the scheduler's step
    count, each stage keeping its own groups' lrs."""
    saved = run_distributed(pipeline_worker, stages, str(tmp_path), stages, "save", True, timeout=240)
    assert [r["held"] for r in saved] == held
    assert "the pipeline's stages passed different lists of param groups" in capfd.readouterr().out
    refused = run_distributed(pipeline_worker, stages, str(tmp_path), stages, "refused", True, timeout=240)
    for rank, (s, r) in enumerate(zip(saved, refused)):
        assert "stages passed different lists of param groups" in r["error"], r["error"]
        assert "load_optimizer_states=False" in r["error"]
        assert r["steps"] == SAVE_AT + 1
        assert r["lr"] == s["lrs"][SAVE_AT], f"rank {rank}: {r['lr']} vs {s['lrs']}"


def bad_group_worker():
    """A frozen group listed first, then one whose lr is not a number: the error names the second."""
    import torch
    import zeroshard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
        model_parameters=[{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": "fast"}])
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    try:
        engine.step()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return str(e)
    return None


def test_a_bad_hyperparameter_is_named_by_its_listed_group():
    error = run_distributed(bad_group_worker, 1)[0]
    assert error is not None and 'optimizer.param_groups[1]["lr"]' in error, error


def named_client_worker():
    """A client AdamW built from named parameters, as Hugging Face's Trainer builds its groups: each
    group holds its stage's names ("param_names"), which differ between stages."""
    import torch
    import zeroshard
    from pipe_models import layer_specs, loss_fn
    from zeroshard.pipe import PipelineModule
    net = PipelineModule(layers=layer_specs(4, tied=False), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    named = list(net.named_parameters())
    client = torch.optim.AdamW([{"params": [(n, p) for n, p in named if p.dim() > 1], "weight_decay": 0.1},
                                {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-3)
    config = {k: v for k, v in _config(MICRO, GAS).items() if k != "optimizer"}
    engine, optimizer, _, _ = zeroshard.initialize(model=net, optimizer=client, config=config)
    return optimizer.numbered_alike, client.param_groups[0]["param_names"][:1]


def test_a_client_optimizer_of_named_parameters_is_numbered_alike(capfd):
    results = run_distributed(named_client_worker, 2)
    assert [alike for alike, _ in results] == [True, True]
    assert results[0][1] != results[1][1], "the stages' names differ, which the fingerprint leaves out"
    assert "different lists of param groups" not in capfd.readouterr().out


def test_sequential_lr_inner_schedulers_are_placed_group_by_group():
    """scheduler_state_for_run on a SequentialLR of two LambdaLRs: from a stage that numbered its
    own groups (targets None) each inner scheduler keeps this run's base_lrs and takes the saved step;
    from an older checkpoint with one group fewer, the saved lists land on their groups."""
    import torch
    from zeroshard.checkpoint.groups import scheduler_state_for_run

    def scheduler(lrs, steps):
        opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])
        inner = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s) for _ in range(2)]
        sched = torch.optim.lr_scheduler.SequentialLR(opt, inner, milestones=[2])
        for _ in range(steps):
            opt.step()
            sched.step()
        return sched

    mine = scheduler([5.0, 50.0, 500.0], 0)
    stage0 = scheduler([1.0, 10.0, 20.0], 3).state_dict()
    got = scheduler_state_for_run(stage0, mine, None, 3)
    assert got["last_epoch"] == 3
    for state in got["_schedulers"]:
        assert state["base_lrs"] == [5.0, 50.0, 500.0]
    assert [s["last_epoch"] for s in got["_schedulers"]] == [s["last_epoch"] for s in stage0["_schedulers"]]
    older = scheduler([1.0, 10.0], 3).state_dict()
    got = scheduler_state_for_run(older, mine, [1, 2], 3)
    for state in got["_schedulers"]:
        assert state["base_lrs"] == [5.0, 1.0, 10.0]
        assert len(state["lr_lambdas"]) == 3
