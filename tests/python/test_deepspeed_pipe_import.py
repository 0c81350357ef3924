"""Checkpoints that DeepSpeed 0.19.8's PipelineEngine saved (tests/fixtures/deepspeed_pipe/<case>/,
made by make_fixture.py there) load with load_checkpoint the way a DeepSpeed script calls it:
into the same layers as a zeroshard pipeline of 2 stages and of 1, and without a pipeline.
- "tied_embed": 2 stages, ZeRO 0, the embedding tied to the unembedding (through forward_fn).
- "bf16": the same layers in bf16 at ZeRO 1 (DeepSpeed's bf16_zero_pp_rank_* files, its ZeRO-1 optimizer).
- "megatron": 2 stages x 2 data, ZeRO 1, Megatron's topology (files named layer_NN-model_00-...),
  a block with a buffer, and a Linear tied across the stages and used as itself twice.
- "untied": 2 stages, ZeRO 1, no tie.
Each load gets DeepSpeed's weights and buffers exactly, the loss DeepSpeed's eval_batch gave on a
fixed batch after the save, and its step counters, LR schedule and client_state. Under ZeRO the
fp32 masters and Adam state load too, into a pipeline of any number of stages and data-parallel
ranks (or without a pipeline where nothing is tied), and the next step is DeepSpeed's own next
step. Without ZeRO (tied_embed) a load that asks for the optimizer state is refused before
anything is written."""
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed_pipe")
# The fixtures' layers, batches and settings, under a name of its own (tests/fixtures/deepspeed/ has
# a make_fixture.py too, which test_checkpoint_reshard.py imports by that name).
_spec = importlib.util.spec_from_file_location("deepspeed_pipe_fixture", os.path.join(FIXTURES, "make_fixture.py"))
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)

CASES = sorted(made.CASES)
RTOL = {"bf16": 1e-2}  # else 1e-5 (fp32: only the summation order may differ)


def _expected(case):
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        return json.load(f)


def _ckpt(case):
    return os.path.join(FIXTURES, case, "ckpt")


def _expected_state(case):
    """DeepSpeed's module state_dicts of every stage, in PipelineModule's names (a tie on each
    stage that uses it)."""
    state = {}
    for stage in range(made.STAGES):
        state.update(load_file(os.path.join(FIXTURES, case, f"expected_stage{stage}.safetensors")))
    return state


def _config(case):
    config = made.config(case)
    config["steps_per_print"] = 10 ** 6
    return config


def _numpy(named):
    """Tensors leave a rank's process as numpy arrays (by value; bf16 as the fp32 it widens to)."""
    return {n: (t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).numpy().copy() for n, t in named}


def _same(value, tensor):
    """A returned array equals a tensor exactly (a bf16 one compared as its fp32 widening)."""
    return torch.equal(torch.from_numpy(value), tensor.float() if tensor.dtype == torch.bfloat16 else tensor)


def _pipeline_rank(case, stages, weighted_loss=False, load_dir=None, **load_kwargs):
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from pipe_models import WeightedLoss, loss_fn, rank_micro_batches
    torch.manual_seed(99)  # unlike the checkpoint's weights and buffers, so a missed load shows
    net = PipelineModule(layers=made.layers(case, LayerSpec, TiedLayerSpec), num_stages=stages,
                         loss_fn=WeightedLoss() if weighted_loss else loss_fn)
    engine, _, _, _ = zeroshard.initialize(model=net, config=_config(case),
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    before = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    import logging
    warned = []
    catcher = logging.Handler()
    catcher.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(catcher)
    try:
        path, client = engine.load_checkpoint(load_dir or _ckpt(case), **load_kwargs)
    except ValueError as error:
        unchanged = all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items())
        return {"error": str(error), "unchanged": unchanged}
    loss = engine.eval_batch(rank_micro_batches(made.eval_batch(), made.MICRO, made.GAS, 0))
    return {"path": path, "client": client, "loss": float(loss), "steps": engine.global_steps,
            "samples": engine.global_samples, "scheduler": engine.lr_scheduler.state_dict(),
            "state": _numpy(engine.module.state_dict().items()), "masters": _numpy(_masters(engine)),
            "dtypes": {n: str(t.dtype) for n, t in engine.module.state_dict().items()},
            "warned": [w for w in warned if "left as built" in w]}


def _masters(engine):
    from zeroshard.utils import safe_get_full_fp32_param
    return [(n, safe_get_full_fp32_param(p)) for n, p in engine.module.named_parameters()]


def _expected_optim(case):
    """DeepSpeed's fp32 masters and Adam state ("master/<name>", "exp_avg/<name>", ...) by
    PipelineModule name, a tie's from the first stage that holds it."""
    state = {}
    for stage in range(made.STAGES):
        for key, value in load_file(os.path.join(FIXTURES, case, f"expected_optim_stage{stage}.safetensors")).items():
            state.setdefault(key, value)
    return state


@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("case", CASES)
def test_a_deepspeed_pipeline_checkpoint_loads_into_a_pipeline(case, stages):
    expected, want = _expected(case), _expected_state(case)
    results = run_distributed(_pipeline_rank, stages, case, stages, load_optimizer_states=False, timeout=120)
    held = set()
    for result in results:
        assert result["path"] == os.path.join(_ckpt(case), "step3")
        assert result["client"] == expected["client_state"]
        assert (result["steps"], result["samples"]) == (expected["global_steps"], expected["global_samples"])
        assert result["scheduler"]["last_batch_iteration"] == expected["lr_scheduler"]["last_batch_iteration"]
        assert result["loss"] == pytest.approx(expected["eval_loss"], rel=RTOL.get(case, 1e-5))
        for name, value in result["state"].items():
            assert _same(value, want[name]), name
            assert result["dtypes"][name] == str(want[name].dtype), name
        # Without the optimizer state the fp32 masters are the weights widened, as DeepSpeed makes them.
        for name, value in result["masters"].items():
            assert _same(value, want[name].float()), name
        held |= set(result["state"])
    assert held == set(want), sorted(set(want) ^ held)


def test_a_loss_module_s_buffer_is_left_as_built():
    """DeepSpeed saves the layers only: a loss_fn module's buffer (class weights) is not in the
    checkpoint, and stays as the script built it."""
    want = _expected_state("tied_embed")
    results = run_distributed(_pipeline_rank, 2, "tied_embed", 2, weighted_loss=True, load_optimizer_states=False,
                              timeout=120)
    # Said once, by the rank whose stage writes the loss_fn's tensors (the last).
    assert [r["warned"] for r in results] == [[], ["[rank 1] load_checkpoint: loss_fn.class_weight left as built: "
                                                  "a DeepSpeed pipeline checkpoint holds the layers only"]]
    last = results[-1]["state"]
    assert list(last["loss_fn.class_weight"]) == pytest.approx(list(torch.linspace(0.5, 1.5, 48).numpy()))
    for result in results:
        assert all(_same(v, want[n]) for n, v in result["state"].items()
                   if not n.startswith("loss_fn."))


def test_load_module_only_reads_the_weights_and_nothing_else():
    result, = run_distributed(_pipeline_rank, 1, "tied_embed", 1, load_module_only=True, timeout=120)
    assert (result["steps"], result["samples"], result["scheduler"]["last_batch_iteration"]) == (0, 0, -1)
    assert result["loss"] == pytest.approx(_expected("tied_embed")["eval_loss"], rel=1e-5)


def test_asking_for_the_optimizer_state_without_zero_is_refused_before_anything_is_written():
    results = run_distributed(_pipeline_rank, 2, "tied_embed", 2, timeout=120)  # load_optimizer_states=True
    for result in results:
        assert ("(ZeRO stage 0), whose optimizer state is a torch state_dict per stage numbered by the stage's "
                "parameter order") in result["error"]
        assert "load_optimizer_states=False" in result["error"]
        assert result["unchanged"]


def _resume_rank(case, stages):
    """The case's checkpoint loaded with its optimizer state into `stages` stages (the world's other
    ranks data-parallel, each step the same global batch as DeepSpeed's), then one train_batch on
    the fixture's next batch."""
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from zeroshard.utils import safe_get_full_optimizer_state
    from pipe_models import loss_fn, rank_micro_batches
    saved_dp, dp = made.CASES[case][0], int(os.environ["WORLD_SIZE"]) // stages
    torch.manual_seed(99)
    net = PipelineModule(layers=made.layers(case, LayerSpec, TiedLayerSpec), num_stages=stages, loss_fn=loss_fn)
    config = {**_config(case), "gradient_accumulation_steps": made.GAS * saved_dp // dp}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine.load_checkpoint(_ckpt(case))
    optim = [(f"master/{n}", t) for n, t in _masters(engine)]
    optim += [(f"{s}/{n}", safe_get_full_optimizer_state(p, s)) for n, p in engine.module.named_parameters()
              for s in ("exp_avg", "exp_avg_sq")]
    data = rank_micro_batches(made.next_batch(saved_dp), made.MICRO, config["gradient_accumulation_steps"],
                              engine.grid.get_data_parallel_id())
    loss = float(engine.train_batch(data))
    return {"optim": _numpy(optim), "loss": loss, "next": _numpy(engine.module.state_dict().items()),
            "steps": engine.global_steps}


def _plain_resume_rank(case):
    """The case's layers without a pipeline load its optimizer state (refused where it has ties),
    then step once on the next batch."""
    import zeroshard
    from zeroshard.utils import safe_get_full_optimizer_state
    from pipe_models import loss_fn, rank_micro_batches
    model = _plain_model(case)
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(case), model_parameters=model.parameters())
    before = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(_ckpt(case))
    except ValueError as error:
        unchanged = all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items())
        return {"error": str(error), "unchanged": unchanged}
    optim = [(f"master/{n}", t) for n, t in _masters(engine)]
    optim += [(f"{s}/{n}", safe_get_full_optimizer_state(p, s)) for n, p in engine.module.named_parameters()
              for s in ("exp_avg", "exp_avg_sq")]
    losses = []
    for x, y in rank_micro_batches(made.next_batch(1), made.MICRO, made.GAS, 0):
        losses.append(float(loss := loss_fn(engine(x), y)))
        engine.backward(loss)
        engine.step()
    return {"optim": _numpy(optim), "loss": sum(losses) / len(losses), "steps": engine.global_steps,
            "next": _numpy(engine.module.state_dict().items())}


@pytest.mark.parametrize("case, stages, world", [("megatron", 2, 4), ("megatron", 2, 2), ("megatron", 1, 1),
                                                 ("bf16", 2, 2), ("bf16", 1, 1), ("untied", 2, 2),
                                                 ("untied", None, 1)])
def test_a_zero_checkpoint_resumes_as_deepspeed_does(case, stages, world):
    """The masters and Adam state are DeepSpeed's (a tie's from its first stage: DeepSpeed's copies
    on two stages differ by rounding), and the step after the load gives DeepSpeed's loss and
    weights (fp32: 1e-5 of the largest; bf16: the weights within a rounding of bf16). stages None:
    the layers without a pipeline."""
    expected, optim = _expected(case), _expected_optim(case)
    after = {}
    for stage in range(made.STAGES):
        after.update(load_file(os.path.join(FIXTURES, case, f"expected_next_stage{stage}.safetensors")))
    held = set()
    results = (run_distributed(_plain_resume_rank, 1, case, timeout=120) if stages is None
               else run_distributed(_resume_rank, world, case, stages, timeout=120))
    for result in results:
        for key, value in result["optim"].items():
            assert _same(value, optim[key]), key
        held |= set(result["optim"])
        assert result["loss"] == pytest.approx(expected["next_loss"], rel=RTOL.get(case, 1e-5))
        assert result["steps"] == expected["global_steps"] + 1
        for name, value in result["next"].items():
            want = after[name].float()
            err = float((torch.from_numpy(value) - want).abs().max())
            assert err <= (2 ** -7 if case == "bf16" else 1e-5) * float(want.abs().max()), (name, err)
    assert held == set(optim), sorted(held ^ set(optim))


def test_a_tie_s_optimizer_state_needs_its_key_from_a_pipeline():
    """DeepSpeed saves a tie's optimizer state under its TiedLayerSpec key; a model without a
    pipeline has no keys to say which layers that is."""
    result, = run_distributed(_plain_resume_rank, 1, "megatron", timeout=120)
    assert "keeps a tie's optimizer state under its TiedLayerSpec key (tied_modules.embed)" in result["error"]
    assert "load_optimizer_states=False" in result["error"] and result["unchanged"]


def _plain_model(case):
    """The case's layers in one container named by layer index (pipe_models.IndexedLayers)."""
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    from pipe_models import IndexedLayers
    torch.manual_seed(99)  # unlike the checkpoint's weights and buffers, so a missed load shows
    return IndexedLayers(made.layers(case, LayerSpec, TiedLayerSpec))


def _plain_rank(case, variant=None):
    """variant "partial_tie": layer 3 is a ScaledLinear of its own whose weight (only) is layer 1's;
    "shift_param": the block's buffer `shift` is a parameter here; "outside": the container has a
    parameter of its own, outside the layers."""
    import zeroshard
    from pipe_models import D_MODEL, loss_fn
    model = _plain_model(case)
    if variant == "partial_tie":
        own = made.ScaledLinear(D_MODEL)
        own.weight = model._modules["1"].weight
        model._modules["3"] = own
        model.funcs[3] = own
    if variant == "shift_param":
        block = model._modules["2"]
        del block._buffers["shift"]
        block.shift = torch.nn.Parameter(torch.zeros(D_MODEL))
    if variant == "outside":
        model.extra = torch.nn.Parameter(torch.zeros(3))
    config = _config(case)
    config.update(gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=made.MICRO * made.GAS)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config, model_parameters=model.parameters())
    try:
        engine.load_checkpoint(_ckpt(case), load_optimizer_states=False)
    except ValueError as error:
        return {"error": str(error)}
    (x, y), = made.eval_batch()
    with torch.no_grad():
        loss = float(loss_fn(engine(x), y))
    return {"loss": loss, "steps": engine.global_steps, "state": _numpy(engine.module.state_dict().items())}


@pytest.mark.parametrize("case, variant", [("tied_embed", None), ("bf16", None), ("megatron", None), ("untied", None),
                                           ("megatron", "partial_tie"), ("megatron", "shift_param")])
def test_a_deepspeed_pipeline_checkpoint_loads_without_a_pipeline(case, variant):
    """Same loss as DeepSpeed's eval_batch (the mean over equal micro-batches is the batch's mean).
    megatron's tied ScaledLinear (layers 1 and 3) shares its weight, bias and buffer; partial_tie
    shares only the weight, so layer 3's bias and buffer are read from its own file. shift_param: a
    name saved as a buffer loads into a parameter, as DeepSpeed's load_state_dict loads it."""
    expected, want = _expected(case), _expected_state(case)
    result, = run_distributed(_plain_rank, 1, case, variant, timeout=120)
    assert result["steps"] == expected["global_steps"]
    assert result["loss"] == pytest.approx(expected["eval_loss"], rel=RTOL.get(case, 1e-5))
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    ties = {str(i): f"tied_modules.{spec.key}" for i, spec in enumerate(made.layers(case, LayerSpec, TiedLayerSpec))
            if isinstance(spec, TiedLayerSpec)}
    for name, value in result["state"].items():  # a tie's later uses included (state_dict repeats them)
        index, rest = name.split(".", 1)
        stored = f"{ties[index]}.{rest}" if index in ties else name
        assert _same(value, want[stored]), name


def test_without_a_pipeline_what_lies_outside_the_layers_is_still_named():
    """Only a pipeline's loss_fn is left as built: a model's own tensor that no layer file holds
    is refused under strict, as any other missing name."""
    result, = run_distributed(_plain_rank, 1, "tied_embed", "outside", timeout=120)
    assert "missing from the checkpoint: extra" in result["error"], result


def _copy(case, out, skip=(), change=None):
    """A copy of the case's tag directory in `out`, leaving out `skip`; change: file -> its new
    state_dict."""
    out.mkdir(parents=True)
    step = os.path.join(_ckpt(case), "step3")
    for name in os.listdir(step):
        if name not in skip:
            (out / name).write_bytes(open(os.path.join(step, name), "rb").read())
    for name, state in (change or {}).items():
        torch.save(state, out / name)
    return str(out)


def test_the_reader_names_what_it_cannot_read(tmp_path):
    from zeroshard.checkpoint_import.deepspeed_pipe import DeepSpeedPipelineCheckpoint
    step = os.path.join(_ckpt("megatron"), "step3")
    ckpt = DeepSpeedPipelineCheckpoint(step)
    assert (ckpt.num_stages, ckpt.data_parallel_size, ckpt.zero_stage, ckpt.dtype) == (2, 2, 1, "fp32")
    assert ckpt.optimizer.saved and "2.shift" in ckpt.names  # a buffer, as in the state_dict
    assert "5.weight" not in ckpt.names  # a tie's use through forward_fn has no file
    ckpt.share_ties([([0, 5], None), ([1, 3], None)])
    assert "1.weight" in ckpt.names and "3.weight" not in ckpt.names
    layer3 = torch.load(os.path.join(step, "layer_03-model_00-model_states.pt"))
    # Only a later use has a file: its tensors are named by the tie's first layer.
    later = DeepSpeedPipelineCheckpoint(_copy("megatron", tmp_path / "later",
                                              skip={"layer_01-model_00-model_states.pt"}))
    later.share_ties([([1, 3], None)])
    assert torch.equal(later.tensor("1.weight"), layer3["weight"]) and "3.weight" not in later.names
    # A tie's two files that disagree.
    changed = _copy("megatron", tmp_path / "changed", change={"layer_03-model_00-model_states.pt":
                                                               {k: v + 1 for k, v in layer3.items()}})
    with pytest.raises(ValueError, match="layers 1 and 3 share 'weight', but their files hold different values"):
        DeepSpeedPipelineCheckpoint(changed).share_ties([([1, 3], None)])
    twice = _copy("tied_embed", tmp_path / "twice", change={"layer_01-model_00-model_states.pt": {}})
    with pytest.raises(ValueError, match="two files for layer 1"):
        DeepSpeedPipelineCheckpoint(twice)
    experts = _copy("tied_embed", tmp_path / "experts", change={"layer_2_expert_0_mp_rank_00_model_states.pt": {}})
    with pytest.raises(ValueError, match="experts"):
        DeepSpeedPipelineCheckpoint(experts)
    (tmp_path / "tp").mkdir()
    (tmp_path / "tp" / "layer_00-model_01-model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"tensor parallelism \(model ranks 0-1\)"):
        DeepSpeedPipelineCheckpoint(str(tmp_path / "tp"))
    # A checkpoint without optimizer state needs load_optimizer_states=False all the same.
    from zeroshard.checkpoint.sources import DeepSpeedPipelineSource
    from zeroshard.checkpoint_import.deepspeed import load_file as load_ds_file
    step = os.path.join(_ckpt("tied_embed"), "step3")
    stages = {n: {**load_ds_file(os.path.join(step, n)), "optimizer": None}
              for n in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")}
    bare = DeepSpeedPipelineSource(_copy("tied_embed", tmp_path / "bare", change=stages))
    assert bare.section("layout")["optimizer"]["unread"].endswith("(ZeRO stage 0), which holds no optimizer state")
    with pytest.raises(ValueError, match="mp_world_size is 2"):
        DeepSpeedPipelineCheckpoint(_copy("tied_embed", tmp_path / "stage", skip={"mp_rank_01_model_states.pt"}))


def test_consolidation_refuses_it_by_name():
    from zeroshard.utils.zero_to_fp32 import Consolidated
    with pytest.raises(ValueError, match="a DeepSpeed pipeline checkpoint: its layer files do not say"):
        Consolidated(_ckpt("tied_embed"))


def _resave(path, edit):
    """test_deepspeed_import.resave, an optimizer file's edit getting its optimizer_state_dict."""
    from test_deepspeed_import import resave
    resave(path, lambda state: edit(state.get("optimizer_state_dict", state)))


def _damaged_rank(case, load_dir):
    return _pipeline_rank(case, 2, load_dir=load_dir), _pipeline_rank(case, 2, load_dir=load_dir,
                                                                        load_optimizer_states=False)


DAMAGES = {  # case, its file to rewrite, the edit, what the refusal says
    "unreadable": ("bf16", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
                   lambda o: o["single_partition_of_fp32_groups"].__setitem__(0, None),
                   "whose stage 1 optimizer files (*mp_rank_01_optim_states.pt) cannot be read: AttributeError"),
    "a rank without state": ("megatron", "zero_pp_rank_1_mp_rank_01_optim_states.pt",
                             lambda o: o["base_optimizer_state"].__setitem__("state", {}),
                             "zero_pp_rank_1_mp_rank_01_optim_states.pt: flat group 0 holds no state where "
                             "zero_pp_rank_0_mp_rank_01_optim_states.pt's flat group 0 holds "
                             "['exp_avg', 'exp_avg_sq']"),
    "a short moment": ("megatron", "zero_pp_rank_1_mp_rank_01_optim_states.pt",
                       lambda o: o["base_optimizer_state"]["state"][0].__setitem__(
                           "exp_avg", o["base_optimizer_state"]["state"][0]["exp_avg"][:5].clone()),
                       "zero_pp_rank_1_mp_rank_01_optim_states.pt: flat group 0's exp_avg holds 5 elements, "
                       "expected its partition's 536"),
    "no parameter names (bf16 at ZeRO 0)": ("bf16", "mp_rank_01_model_states.pt",
                                            lambda state: state.__setitem__("param_shapes", None),
                                            "whose optimizer files do not name their parameters"),
    "stages' groups differ": ("bf16", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
                              lambda o: o["base_optimizer_state"]["param_groups"][0].__setitem__("lr", 0.5),
                              "whose stages' optimizers hold different param groups"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_optimizer_files_it_cannot_use_are_named_and_the_weights_still_load(tmp_path, damage):
    """Asking for the optimizer state is refused with the reason before anything is written; the
    weights load without it (DeepSpeed's load_optimizer_states=False never opens those files)."""
    case, victim, edit, reason = DAMAGES[damage]
    _resave(_copy(case, tmp_path / "step3") + "/" + victim, edit)
    (tmp_path / "latest").write_text("step3")
    want = _expected_state(case)
    for refused, loaded in run_distributed(_damaged_rank, 2, case, str(tmp_path), timeout=120):
        assert reason in refused["error"] and "load_optimizer_states=False" in refused["error"], refused["error"]
        assert refused["unchanged"]
        assert all(_same(value, want[name]) for name, value in loaded["state"].items())


def test_a_tie_s_optimizer_state_comes_from_a_stage_whose_master_is_the_loaded_weight(tmp_path):
    """DeepSpeed keeps a tie's state on each stage that uses it; the one read is the first whose
    fp32 master rounds to the weight the layer files give, and none is refused."""
    from zeroshard.checkpoint_import.deepspeed_pipe import DeepSpeedPipelineCheckpoint
    ties, keys = [([0, 4], None)], {"tied_modules.embed": "0"}
    stage_file = "bf16_zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"

    def shift(o):
        o["single_partition_of_fp32_groups"][0] = o["single_partition_of_fp32_groups"][0] + 1
    path = _copy("bf16", tmp_path / "ckpt")
    _resave(os.path.join(path, stage_file.format(0)), shift)
    ckpt = DeepSpeedPipelineCheckpoint(path)
    ckpt.share_ties(ties, keys)
    stage1 = load_file(os.path.join(FIXTURES, "bf16", "expected_optim_stage1.safetensors"))
    assert ckpt.optimizer.unread is None
    assert torch.equal(ckpt.optimizer.tensor("master/0.weight"), stage1["master/tied_modules.embed.weight"])
    _resave(os.path.join(path, stage_file.format(1)), shift)
    ckpt = DeepSpeedPipelineCheckpoint(path)
    ckpt.share_ties(ties, keys)
    assert "no stage's fp32 master of 0.weight (tied_modules.embed.weight on 2 stages) rounds to the weight" in \
        ckpt.optimizer.unread
