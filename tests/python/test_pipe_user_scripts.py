"""DeepSpeed users' pipeline scripts end to end on Gloo (DeepSpeedExamples' train.py, Megatron-DeepSpeed's
GPTModelPipe, the call patterns of DeepSpeed's tests/unit/pipe and checkpoint tests), checked against one process
or DeepSpeed's value."""
import argparse
import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed

TOL = 1e-5
VOCAB, D, SEQ, BLOCKS = 24, 16, 6, 4  # the Megatron-style GPT


def _try(out, key, fn):  # fn()'s value or its error: one missing name does not hide the rest
    try:
        out[key] = fn()
    except Exception as error:  # noqa: BLE001 - the test reads it
        out[key] = f"ERROR {type(error).__name__}: {error}"


def _ds_order(dataset, micro, dp, d):  # DeepSpeed's PipelineEngine._build_data_iter: shuffle=False
    from torch.utils.data import DataLoader, DistributedSampler
    return list(DataLoader(dataset, batch_size=micro, sampler=DistributedSampler(dataset, dp, d, shuffle=False)))


class _Chain(nn.Module):
    def __init__(self, funcs):
        super().__init__()
        self.funcs, self.mods = funcs, nn.ModuleList([f for f in funcs if isinstance(f, nn.Module)])

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def _mean_loss(model, per_rank, loss_fn):
    return torch.stack([loss_fn(model(x), y) for mbs in per_rank for x, y in mbs]).mean()


def _ref_step(model, opt, per_rank, loss_fn, clip=1.0):  # the mean over every rank's micro-batches
    opt.zero_grad()
    (loss := _mean_loss(model, per_rank, loss_fn)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(loss), float(norm)


# ----- DeepSpeedExamples training/pipeline_parallelism/train.py -----
def _examples_worker(config_path):
    import torch.distributed as dist
    import zeroshard as deepspeed
    from zeroshard.pipe import PipelineModule
    from zeroshard.utils import RepeatingLoader  # the script: from deepspeed.utils import RepeatingLoader
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    torch.manual_seed(1138)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
              nn.MaxPool2d(2), nn.AdaptiveAvgPool2d((2, 2)), lambda x: torch.flatten(x, 1),
              nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)]  # AlexNet's join_layers shape
    ref = _Chain(copy.deepcopy(layers))
    g = torch.Generator().manual_seed(5)
    trainset = torch.utils.data.TensorDataset(torch.randn(96, 3, 8, 8, generator=g), torch.randint(10, (96,), generator=g))
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")
    engine, _, loader, _ = deepspeed.initialize(args=args, model=net, training_data=trainset,
                                                model_parameters=[p for p in net.parameters() if p.requires_grad])
    rank, dp, gas = dist.get_rank(), engine.dp_world_size, engine.gradient_accumulation_steps()
    stage, d = divmod(rank, dp)
    out = {"dp": dp, "gas": gas, "stage": stage, "data": d, "tbs": engine.train_batch_size()}
    ds_batches = [_ds_order(trainset, 2, dp, e) for e in range(dp)]
    with torch.no_grad():  # DeepSpeed's step-1 loss: its sampler's order, the initial weights
        out["ds_first_loss"] = float(_mean_loss(ref, [b[:gas] for b in ds_batches], F.cross_entropy))
    it, everyone = iter(loader), [None] * dist.get_world_size()  # the order zeroshard's engine reads
    dist.all_gather_object(everyone, [next(it) for _ in range(3 * gas)])
    engine_order = everyone[:dp]  # ranks 0..dp-1: stage 0's data ranks
    losses = [float(engine.train_batch())]
    out["grad_norm"], out["applied"] = engine.get_global_grad_norm(), engine.was_step_applied()
    losses.append(float(engine.train_batch()))
    _try(out, "agg_train_loss", lambda: float(engine.agg_train_loss))
    _try(out, "total_loss", lambda: None if engine.total_loss is None else float(engine.total_loss))
    _try(out, "additional", lambda: engine.get_additional_losses())
    _try(out, "empty_cache", lambda: engine.empty_partition_cache() or "ok")
    evaluation = [[(torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g)) for _ in range(gas)]
                  for _ in range(dp)]
    out["eval"] = float(engine.eval_batch(iter(evaluation[d])))
    losses.append(float(engine.train_batch()))  # reads on from training_data, as after DeepSpeed's eval
    losses.append(float(engine.train_batch(data_iter=iter(RepeatingLoader(ds_batches[d])))))
    out["losses"], out["global_steps"], out["global_samples"] = losses, engine.global_steps, engine.global_samples
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    steps = [[b[k * gas:(k + 1) * gas] for b in engine_order] for k in range(3)] + [[b[:gas] for b in ds_batches]]
    out["ref_losses"], norms = zip(*[_ref_step(ref, opt, batch, F.cross_entropy) for batch in steps[:2]])
    with torch.no_grad():
        out["ref_eval"] = float(_mean_loss(ref, evaluation, F.cross_entropy))
    out["ref_losses"] += tuple(_ref_step(ref, opt, batch, F.cross_entropy)[0] for batch in steps[2:])
    out["ref_grad_norm"] = norms[0]
    grid = engine.grid
    out["acc"] = acc = {
        "first_last": (engine.is_first_stage(), engine.is_last_stage()),
        "ids": (engine.stage_id, engine.num_stages, engine.micro_batches, engine.global_rank),
        "grid": (grid.get_stage_id(), grid.get_data_parallel_id(), tuple(net.topology().get_coord(rank))),
        "module_mpu_is_grid": engine.module.mpu() is grid and len(net.parts) == 3}
    _try(acc, "mpu_is_grid", lambda: engine.mpu is grid)
    _try(acc, "is_pipe_parallel", lambda: engine.is_pipe_parallel)
    _try(acc, "is_data_parallel", lambda: engine.is_data_parallel)
    out["layout"] = lay = {}
    _try(lay, "range", lambda: (net._local_start, net._local_stop) == (net.parts[stage], net.parts[stage + 1]))
    _try(lay, "forward_funcs", lambda: len(net.forward_funcs) == net.parts[stage + 1] - net.parts[stage])
    _try(lay, "partitions", lambda: net.partitions() == net.parts)
    _try(lay, "stage_owner", lambda: [net.stage_owner(i) for i in (0, len(layers) - 1)] == [0, 1])
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2x1", "2x2"])
def examples_run(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}}}))
    return run_distributed(_examples_worker, request.param, str(path), timeout=150)


def test_examples_train_py_losses_and_accessors(examples_run):
    for rank, r in enumerate(examples_run):
        assert r["gas"] == 8 // (2 * r["dp"]) and r["tbs"] == 8 and r["applied"], r  # gas from train_batch_size
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, (r["losses"], r["ref_losses"])
        assert abs(r["eval"] - r["ref_eval"]) < TOL, (r["eval"], r["ref_eval"])
        assert abs(float(r["grad_norm"]) - r["ref_grad_norm"]) < TOL, (r["grad_norm"], r["ref_grad_norm"])
        assert r["global_steps"] == 4 and r["global_samples"] == 4 * 8, r
        a, s, d = r["acc"], r["stage"], r["data"]  # DeepSpeed's accessors
        assert a["first_last"] == (s == 0, s == 1) and a["ids"] == (s, 2, r["gas"], rank), a
        assert a["grid"] == (s, d, (s, d)) and a["module_mpu_is_grid"], a


def test_examples_training_data_is_read_in_deepspeeds_order(examples_run):
    # DeepSpeed's PipelineEngine._build_data_iter reads training_data with DistributedSampler(shuffle=False).
    for r in examples_run:
        assert abs(r["losses"][0] - r["ds_first_loss"]) < TOL, (r["losses"][0], r["ds_first_loss"])


def test_examples_engine_attributes_deepspeed_sets(examples_run):
    # DeepSpeed's PipelineEngine has is_pipe_parallel, is_data_parallel, mpu (the grid), agg_train_loss,
    # total_loss, get_additional_losses() (Megatron-DeepSpeed's train_step calls it) and
    # empty_partition_cache() (tests/unit/checkpoint/common.py calls it).
    for r in examples_run:
        a = r["acc"]
        assert (a["mpu_is_grid"], a["is_pipe_parallel"], a["is_data_parallel"]) == (True, True, r["dp"] > 1), a
        assert r["agg_train_loss"] == r["losses"][1] and r["additional"] is None and r["empty_cache"] == "ok", r
        if r["dp"] == 1:  # the last stage's sum over micro-batches; None on the first
            want = r["losses"][1] * r["gas"] if r["stage"] == 1 else None
            assert (r["total_loss"] is want) if want is None else abs(r["total_loss"] - want) < 1e-4, r["total_loss"]


def test_examples_module_layer_range_accessors(examples_run):
    # DeepSpeed's PipelineModule has _local_start/_local_stop, forward_funcs (its checkpoint/test_pipeline.py
    # reads them), partitions(), stage_owner().
    for r in examples_run:
        assert r["layout"] == dict.fromkeys(("range", "forward_funcs", "partitions", "stage_owner"), True), r["layout"]


# ----- Megatron-DeepSpeed: megatron/model/gpt_model.py GPTModelPipe, megatron/training.py -----
class EmbeddingPipe(nn.Module):  # Megatron's: the tie names only the word embedding
    def __init__(self, vocab, d):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, d), nn.Embedding(SEQ, d)

    word_embeddings_weight = property(lambda self: self.word_embeddings.weight)

    def forward(self, inputs):  # (tokens, position_ids, attention_mask)
        return self.word_embeddings(inputs[0]) + self.position_embeddings(inputs[1]), inputs[2]


class ParallelTransformerLayerPipe(nn.Module):
    def __init__(self, d, layer_number=0):
        super().__init__()
        self.ln, self.qkv, self.fc = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, inputs):
        h, mask = inputs  # mask: bool (1, 1, s, s), True where attention is masked
        x = self.qkv(self.ln(h))
        scores = (x @ x.transpose(-1, -2) / D ** 0.5).masked_fill(mask[0], -1e4)
        return h + self.fc(torch.softmax(scores, -1) @ x), mask


def _specs():  # [_to_float16 (fp32: a no-op), embed, blocks, drop the mask, norm, tied logits]
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    tied = dict(tied_weight_attr="word_embeddings_weight")
    return ([lambda x: x, TiedLayerSpec("embed", EmbeddingPipe, VOCAB, D, **tied)] +
            [LayerSpec(ParallelTransformerLayerPipe, D, layer_number=i) for i in range(BLOCKS)] +
            [lambda x: x[0], LayerSpec(nn.LayerNorm, D), TiedLayerSpec(
                "embed", EmbeddingPipe, VOCAB, D, forward_fn=lambda e, h: h @ e.word_embeddings_weight.t(), **tied)])


def _lm_loss(output, labels):
    labels, loss_mask = labels
    losses = F.cross_entropy(output.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="none")
    return (losses * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def _batch_fn(data):  # Megatron's get_batch_pipe: ((tokens, position_ids, attention_mask), (labels, loss_mask))
    tokens, labels = data["text"][:, :-1], data["text"][:, 1:]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    return (tokens, torch.arange(SEQ).expand_as(tokens), mask), (labels, (labels != 0).float())


def _gpt_model_pipe():
    from zeroshard.pipe import PipelineModule
    from zeroshard.pipe.topology import PipeModelDataParallelTopology

    class GPTModelPipe(PipelineModule):
        def __init__(self):
            self.specs = _specs()  # set before nn.Module.__init__, as Megatron's class does
            topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
            super().__init__(layers=self.specs, loss_fn=self.loss_func, topology=topo,
                             activation_checkpoint_interval=1, partition_method="type:transformer")

        def loss_func(self, output, labels):
            return _lm_loss(output, labels)

        def get_additional_losses(self):  # Megatron's, without MoE
            return None
    return GPTModelPipe()


def _gathered_reference(net):  # one process, every stage's current weights, a tie one module
    import torch.distributed as dist
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: p.detach().clone() for n, p in net.named_parameters()})
    state = {k: v for w in reversed(every) for k, v in w.items()}  # a tie: the first stage's copy
    funcs, built = [], {}
    for idx, spec in enumerate(_specs()):
        key = getattr(spec, "key", idx)
        if hasattr(spec, "build") and key not in built:
            prefix, built[key] = (f"tied_modules.{key}." if key != idx else f"{idx}."), spec.build()
            built[key].load_state_dict({n[len(prefix):]: t for n, t in state.items() if n.startswith(prefix)})
        module, fwd = built.get(key, spec), getattr(spec, "forward_fn", None)
        funcs.append((lambda x, f=fwd, m=module: f(m, x)) if fwd else module)
    return _Chain(funcs), every


def _megatron_worker(save_dir, empty_dir):
    import torch.distributed as dist
    import zeroshard as deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # Megatron initializes before building the model
    torch.manual_seed(1234 + dist.get_rank())  # each stage draws its own weights
    net, g = _gpt_model_pipe(), torch.Generator().manual_seed(9)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 1.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 1000,
              "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
    grid = engine.grid  # training.py checks these three against Megatron's mpu
    out = {"is_engine": isinstance(engine, deepspeed.PipelineEngine), "parts": list(net.parts), "ranks": (
        grid.get_pipe_parallel_rank(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank())}
    engine.set_batch_fn(_batch_fn)  # training.py: model.set_batch_fn(model.module._megatron_batch_fn)
    data = [{"text": torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)} for _ in range(12)]
    ref, _ = _gathered_reference(net)
    (loss := _mean_loss(ref, [[_batch_fn(b) for b in data[:3]]], _lm_loss)).backward()
    out["ref"] = (float(loss), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)))
    data_iterator, out["losses"] = iter(data), []
    for _ in range(3):  # training.py train_step
        out["losses"].append(float(engine.train_batch(data_iter=data_iterator)))
        out.setdefault("norm", engine.get_global_grad_norm())
        out["additional"], out["applied"] = engine.get_additional_losses(), engine.was_step_applied()
    ref, every = _gathered_reference(net)
    out["tie_equal"] = torch.equal(*[w["tied_modules.embed.word_embeddings.weight"] for w in every])
    engine.reset_activation_shape()  # training.py, before evaluate()
    with torch.no_grad():
        out["ref_eval"] = float(_mean_loss(ref, [[_batch_fn(b) for b in data[9:12]]], _lm_loss))
    out["eval"] = float(engine.eval_batch(iter(data[9:12])))
    # megatron/checkpointing.py: save with client_state (tag None), then a fresh model loads it.
    engine.save_checkpoint(save_dir, client_state={"iteration": 3})
    out["latest"] = open(f"{save_dir}/latest").read().strip()
    torch.manual_seed(99)
    net2 = _gpt_model_pipe()
    other = deepspeed.initialize(model=net2, config=config, model_parameters=list(net2.parameters()))[0]
    other.set_batch_fn(_batch_fn)
    _try(out, "load_missing", lambda: other.load_checkpoint(empty_dir))  # DeepSpeed: (None, None), Megatron warns
    path, client = other.load_checkpoint(save_dir, load_module_strict=True, tag=None)
    out["client"] = path is not None and client.get("iteration")
    outputs = [e.eval_batch(iter(data[9:12]), compute_loss=False, reduce_output=None) for e in (engine, other)]
    out["outputs_equal"] = outputs[0] is None or all(map(torch.equal, *outputs))
    out["next"] = [float(e.train_batch(iter(data[6:9]))) for e in (engine, other)]
    return out


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    save, empty = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("none")
    return run_distributed(_megatron_worker, 2, str(save), str(empty), timeout=120)


def test_megatron_gpt_model_pipe(megatron_run):
    from zeroshard.pipe.module import partition_layers  # the bracketed form scripts write too
    assert partition_layers(_specs(), 2, "type:[Tt]ransformer") == [0, 4, 9]
    for stage, r in enumerate(megatron_run):
        assert r["is_engine"] and r["ranks"] == (stage, 0, 0), r
        assert r["parts"] == [0, 4, 9], r["parts"]  # DeepSpeed's 'type:transformer' split
        assert abs(r["losses"][0] - r["ref"][0]) < TOL, (r["losses"], r["ref"])
        assert abs(float(r["norm"]) - r["ref"][1]) < TOL, (r["norm"], r["ref"])  # the tie counted once
        assert r["additional"] is None and r["applied"] and r["tie_equal"], r
        assert abs(r["eval"] - r["ref_eval"]) < TOL, (r["eval"], r["ref_eval"])
        assert r["latest"] == "global_step3" and r["client"] == 3 and r["outputs_equal"], r
        assert r["next"][0] == r["next"][1] and r["load_missing"] == (None, None), r  # DeepSpeed: (None, None)


# ----- DeepSpeed's tests/unit/pipe/test_pipe_module.py and tests/unit/runtime/pipe/test_pipe.py -----
_SIMPLE = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.001, "eps": 1e-8, "weight_decay": 3e-7}},
           "pipeline": {"activation_checkpoint_interval": 1}}


def _pipe_module_worker():
    import itertools
    import torch.distributed as dist
    import zeroshard as deepspeed
    from zeroshard.pipe import PipelineModule
    from zeroshard.pipe.topology import PipeDataParallelTopology
    out = {}
    torch.manual_seed(0)  # test_pipe_module.py: an nn.Sequential as the layers, eval_batch against it
    sequential = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)], nn.Linear(32, 1))
    x, pipe = torch.randn(1, 32), PipelineModule(layers=copy.deepcopy(sequential), num_stages=2)
    count = torch.LongTensor([sum(p.numel() for p in pipe.parameters())])
    dist.all_reduce(count)
    out["params"] = (int(count), sum(p.numel() for p in sequential.parameters()))
    engine, _, _, _ = deepspeed.initialize(config=_SIMPLE, model=pipe, model_parameters=list(pipe.parameters()))
    _try(out, "configure", lambda: deepspeed.checkpointing.configure(
        None, deepspeed_config=engine.config, partition_activations=True, contiguous_checkpointing=True,
        num_checkpoints=9) or "ok")
    out["eval_err"] = float((engine.eval_batch(data_iter=itertools.cycle([(x, 0)])) - sequential(x)).abs().max())
    # test_pipe.py's config: pipeline.seed_layers, the PipelineModule built without it.
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 0}, "fp16": {"enabled": False},
              "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
              "pipeline": {"seed_layers": True, "activation_checkpoint_interval": 1}}
    net = PipelineModule(layers=[nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)], loss_fn=nn.CrossEntropyLoss(),
                         topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    _try(out, "seed_layers_config",
         lambda: deepspeed.initialize(config=config, model=net, model_parameters=list(net.parameters())) and "ok")
    return out


@pytest.fixture(scope="module")
def pipe_module_run():
    return run_distributed(_pipe_module_worker, 2, timeout=120)


def test_sequential_as_layers_evaluates_as_the_model(pipe_module_run):
    for r in pipe_module_run:
        assert r["params"][0] == r["params"][1] and r["eval_err"] < 1e-4, r


def test_checkpointing_configure_as_test_pipe_module_calls_it(pipe_module_run):
    # tests/unit/pipe/test_pipe_module.py's configure(None, partition_activations=True,
    # contiguous_checkpointing=True, ...) runs in DeepSpeed (no mpu: one tensor-parallel rank).
    for r in pipe_module_run:
        assert r["configure"] == "ok", r["configure"]


def test_pipeline_seed_layers_in_config_disagreeing_with_the_module_is_an_error(pipe_module_run):
    # tests/unit/runtime/pipe/test_pipe.py sets pipeline.seed_layers with PipelineModule(seed_layers=False);
    # DeepSpeed never reads the key (its layers are built before the engine), so it silently does nothing.
    # A deliberate departure: zeroshard says so, naming the key and what to do (README, Pipelines).
    for r in pipe_module_run:
        assert r["seed_layers_config"].startswith("ERROR ValueError: pipeline.seed_layers: got True"), r
        assert "pass it to PipelineModule" in r["seed_layers_config"], r


def _inplace_worker(schedule):
    """AlexNet's nn.ReLU(inplace=True) opening stage 1; three steps against one process with Adam. Then
    what a pipeline refuses: a module's additional (MoE) losses, one-range accessors with two chunks
    per rank, a layer index out of range."""
    import zeroshard as deepspeed
    from zeroshard.pipe import PipelineModule
    torch.manual_seed(1)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)]
    ref = _Chain(copy.deepcopy(layers))
    net = PipelineModule(layers=layers, loss_fn=nn.MSELoss(), num_stages=2, partition_method="uniform")
    config = dict(_SIMPLE, pipeline={"schedule": schedule})
    engine = deepspeed.initialize(config=config, model=net, model_parameters=list(net.parameters()))[0]
    opt = torch.optim.AdamW(ref.parameters(), lr=0.001, eps=1e-8, weight_decay=3e-7)  # DeepSpeed's Adam: adam_w_mode
    g = torch.Generator().manual_seed(3)
    out = {"parts": net.parts, "losses": [], "ref": []}
    for _ in range(3):
        data = [(torch.randn(1, 8, generator=g), torch.randn(1, 4, generator=g)) for _ in range(2)]
        out["losses"].append(float(engine.train_batch(iter(data))))
        out["ref"].append(_ref_step(ref, opt, [data], F.mse_loss, clip=1e9)[0])
    net.get_additional_losses = lambda: {"moe_loss": torch.tensor(0.1)}
    _try(out, "additional", lambda: engine.train_batch(iter(data)))
    chunked = PipelineModule(layers=[nn.Linear(8, 8) for _ in range(4)], num_stages=2, virtual_stages=2)
    _try(out, "chunked", lambda: chunked.forward_funcs)
    _try(out, "owner", lambda: [chunked.stage_owner(i) for i in range(4)])
    _try(out, "out_of_range", lambda: chunked.stage_owner(4))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_stage_starting_with_an_inplace_relu_trains(schedule):
    # DeepSpeed's PipelineEngine._exec_forward_pass clones received activations, so nn.ReLU(inplace=True)
    # (AlexNet's) may open a stage; zero bubble's split backward goes through the copy too.
    for rank, r in enumerate(run_distributed(_inplace_worker, 2, schedule, timeout=120)):
        assert r["parts"] == [0, 2, 4], r["parts"]  # the in-place ReLU opens stage 1
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref"])) < TOL, (r["losses"], r["ref"])
        # The last stage says why; the first names the stage and micro-batch that failed.
        assert ("ERROR PipelineError: pipeline: micro-batch 0: the PipelineModule's get_additional_losses() "
                "returned losses" if rank else "pipeline stage 1 forward of micro-batch 0") in r[
                    "additional"], r["additional"]
        assert r["chunked"].startswith("ERROR ValueError: PipelineModule.forward_funcs: this rank holds 2"), r
        assert r["owner"] == [0, 1, 0, 1], r["owner"]  # global stage s runs on rank s % 2
        assert r["out_of_range"].startswith("ERROR ValueError: stage_owner: layer 4, the module has layers 0-3")


# ----- the names the scripts import -----
def test_utils_names_the_example_scripts_import(compat_python):
    # train.py, tests/unit/pipe/test_pipe_module.py, tests/unit/alexnet_model.py use
    # deepspeed.utils.RepeatingLoader and deepspeed.runtime.utils.set_random_seed; Megatron-DeepSpeed's
    # pretrain_gpt.py imports see_memory_usage; RepeatingLoader's home is deepspeed.runtime.dataloader.
    import subprocess
    script = ("from deepspeed.utils import RepeatingLoader; import deepspeed.runtime.utils as u; u.set_random_seed(7)\n"
              "from deepspeed.runtime.utils import see_memory_usage\n"
              "from deepspeed.runtime.dataloader import RepeatingLoader as R; assert R is RepeatingLoader\n"
              "import random, numpy; a = (random.random(), numpy.random.rand()); u.set_random_seed(7)\n"
              "assert a == (random.random(), numpy.random.rand())\n"
              "see_memory_usage('after the model', force=True); see_memory_usage('not shown')\n"
              "it = iter(RepeatingLoader([1, 2])); assert [next(it) for _ in range(3)] == [1, 2, 1]\n"
              "try:\n    u.call_to_str\nexcept AttributeError as e:\n    print(e)")
    run = subprocess.run([compat_python, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-800:]
    logged = run.stdout + run.stderr
    assert "after the model\nMA " in logged and "CPU Virtual Memory: used = " in logged, logged
    assert "not shown" not in logged and "(zeroshard's compatibility package) has no attribute 'call_to_str'" in logged


def test_repeating_loader_says_why_it_cannot_repeat():
    from zeroshard.utils import RepeatingLoader
    once = RepeatingLoader(iter([1, 2]))  # an iterator: one epoch only
    assert [next(once), next(once)] == [1, 2]
    with pytest.raises(ValueError, match="list_iterator it repeats cannot be started again"):
        next(once)
    with pytest.raises(ValueError, match="list it repeats yields no batch"):
        next(RepeatingLoader([]))

    class ReadOnce(torch.utils.data.IterableDataset):  # a stream: its second epoch is empty
        def __init__(self):
            self.left = [1, 2]

        def __iter__(self):
            while self.left:
                yield self.left.pop(0)
    once = RepeatingLoader(torch.utils.data.DataLoader(ReadOnce(), batch_size=None))
    assert [next(once), next(once)] == [1, 2]
    with pytest.raises(ValueError, match="DataLoader it repeats yielded nothing when started again"):
        next(once)
