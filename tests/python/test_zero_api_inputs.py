"""Every public ZeRO entry point acts on its input or says why it cannot (issue 24, part 3): each
test here is a case that used to be ignored without a word."""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed

V, D = 16, 8


def _config(stage, precision="fp32", **zero):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, **zero}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _rank():
    return int(os.environ["RANK"])


def zero_init_inputs_worker():
    import zeroshard
    from zeroshard.zero import Init
    for kwargs, key in (({"zero_param_parallel_group": object()}, "zero_param_parallel_group"),
                        ({"sequence_data_parallel_group": object()}, "sequence_data_parallel_group"),
                        ({"param_swapper": object()}, "param_swapper"),
                        ({"remote_device": "nvme"}, "remote_device='nvme'"),
                        ({"zero_quantized_weights": True}, "quantized")):
        with pytest.raises(ValueError, match=key):
            Init(**kwargs)
    # remote_device "nvme" needs the config that says where (DeepSpeed's pairing); with it, Init
    # partitions as usual and initialize() moves the chunks to disk (test_nvme_api.py).
    with pytest.raises(ValueError, match=r"remote_device='nvme'.*offload_param\.device"):
        Init(remote_device="nvme", config_dict_or_path=_config(3))
    offload = _config(3)
    offload["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/tmp"}
    with Init(remote_device="nvme", config_dict_or_path=offload):
        on_nvme = nn.Linear(4, 4)
    assert on_nvme.weight.ds_numel == 16
    offload["zero_optimization"]["stage"] = 2
    with pytest.raises(ValueError, match=r'offload_param\.device: got "nvme" at stage 2'):
        Init(config_dict_or_path=offload)
    # The config's precision is the model dtype (DeepSpeed's zero.Init), an explicit dtype wins.
    with Init(config_dict_or_path=_config(3, "bf16")):
        bf16 = nn.Linear(4, 4)
    with Init(config=_config(3, "bf16"), dtype=torch.float32):
        fp32 = nn.Linear(4, 4)
    assert bf16.weight.dtype == torch.bfloat16 and fp32.weight.dtype == torch.float32
    assert bf16.weight.ds_shape == (4, 4) and bf16.weight.ds_numel == 16
    # No engine holds it yet: the inspection API says so instead of returning None.
    from zeroshard.utils import safe_get_full_fp32_param
    with pytest.raises(ValueError, match="no engine holds it yet"):
        safe_get_full_fp32_param(bf16.weight)
    assert safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2))) is None  # as DeepSpeed
    with pytest.raises(ValueError, match="expected parameters .tensors., got a Linear"):
        zeroshard.zero.GatheredParameters([bf16])


def test_zero_init_refuses_what_it_cannot_do_and_follows_the_config_dtype():
    run_distributed(zero_init_inputs_worker, 1)


class CapturedReference(nn.Module):
    """`reader` keeps the other module's weight by reference and never reads it as a module
    attribute, so no read can be seen: DeepSpeed scripts declare it with
    register_external_parameter or GatheredParameters(fwd_module=...)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.reader = nn.Linear(D, D)
        self.reader.captured = [self.emb.weight]

    def forward(self, batch):
        h = torch.tanh(self.reader(self.emb(batch[:, :-1])))
        logits = h @ self.reader.captured[0].t()
        return F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))


def declared_external_worker(how):
    import zeroshard
    from zeroshard.zero import GatheredParameters, register_external_parameter
    rank = _rank()
    if how == "fwd_module":
        with zeroshard.zero.Init():
            torch.manual_seed(0)
            model = CapturedReference()
        with GatheredParameters([model.emb.weight], fwd_module=model):
            pass
        torch.manual_seed(0)
        reference = CapturedReference()
    else:
        torch.manual_seed(0)
        model = CapturedReference()
        reference = copy.deepcopy(model)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(3))
    if how == "after initialize":
        register_external_parameter(model, model.emb.weight)
        with pytest.raises(ValueError, match="does not contain this Linear"):
            register_external_parameter(nn.Linear(2, 2), model.emb.weight)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        batch = torch.randint(0, V, (4, 6), generator=g)
        engine.backward(engine(batch[2 * rank:2 * rank + 2]))
        engine.step()
        opt.zero_grad()
        (sum(reference(batch[2 * r:2 * r + 2]) for r in range(2)) / 2).backward()
        opt.step()
    from zeroshard.utils import safe_get_full_fp32_param
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert (safe_get_full_fp32_param(p) - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("how", ["fwd_module", "after initialize"])
def test_declared_external_parameters_are_gathered(how):
    """GatheredParameters' fwd_module was ignored, and register_external_parameter after
    initialize() was too (the list was read once): the captured weight stayed empty."""
    run_distributed(declared_external_worker, 2, how)


def whole_modifier_worker(stage, precision):
    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param
    from zeroshard.zero import GatheredParameters
    rank = _rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1))
    model[2].bias.requires_grad_(False)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(stage, precision))
    weight = model[0].weight
    frozen = model[2].bias  # frozen: whole on every rank and held by no optimizer
    with GatheredParameters([weight, frozen], modifier_rank=1):
        with torch.no_grad():
            weight.fill_(0.25 if rank == 1 else -1.0)  # only rank 1's edit is kept
            frozen.fill_(0.5 if rank == 1 else -1.0)
    assert torch.all(frozen == 0.5)
    assert torch.all(weight == 0.25)  # the model copy on every rank
    assert torch.all(safe_get_full_fp32_param(weight) == 0.25)  # and the master weights
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x[2 * rank:2 * rank + 2].to(weight.dtype)).float().pow(2).mean())
    engine.step()  # a step recomputes the model copy from the master: the edit stays
    moved = safe_get_full_fp32_param(weight)
    assert (moved - 0.25).abs().max() < 1e-2 and not torch.all(moved == 0.25)
    values = [torch.zeros_like(weight, dtype=torch.float32) for _ in range(2)]
    torch.distributed.all_gather(values, weight.detach().float())
    assert torch.equal(values[0], values[1])


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_modifier_rank_edits_of_whole_parameters_reach_every_rank(stage, precision):
    """Stages 0-2 hold whole parameters, so GatheredParameters had nothing to gather and its
    modifier_rank did nothing: the edit stayed on one rank (fp32), or the next step overwrote it
    from the master copy (bf16)."""
    run_distributed(whole_modifier_worker, 2, stage, precision)


def attribute_worker():
    import zeroshard
    model = nn.Linear(2, 2)
    model.custom = 7
    engine, *_ = zeroshard.initialize(model=model, config=_config(1))
    assert engine.custom == 7 and engine.in_features == 2  # DeepSpeed's fall-through
    with pytest.raises(AttributeError, match="has no attribute 'nothing', nor has the Linear"):
        engine.nothing


def test_engine_attributes_fall_through_to_the_module_and_say_when_neither_has_one():
    run_distributed(attribute_worker, 1)


def group_worker():
    import io
    import torch.distributed as dist
    import zeroshard
    from zeroshard.zero import GatheredParameters, Init
    rank = _rank()
    zeroshard.init_distributed()
    solo = dist.new_group([0])  # every rank creates it; only rank 0 is in it
    if rank == 1:
        with pytest.raises(ValueError, match="rank 1 is not a member of that group"):
            Init(data_parallel_group=solo).__enter__()
        return
    with Init(data_parallel_group=solo):
        model = nn.Linear(4, 4)
    # Partitioned over a world of one: rank 1 is no rank of it.
    with pytest.raises(ValueError, match=r"modifier_rank=1\): expected None or a rank in 0..0"):
        GatheredParameters(model.weight, modifier_rank=1)
    # A pickled zero.Init model loads, but its chunks cannot be gathered: said, not guessed.
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy_ = torch.load(buf, weights_only=False)
    with pytest.raises(ValueError, match="holds only its chunk and no communicator"):
        with GatheredParameters(copy_.weight):
            pass


def test_a_world_the_rank_is_not_part_of_is_named():
    run_distributed(group_worker, 2)


def refused_config_worker():
    import zeroshard
    model = nn.Linear(2, 2)
    cfg = _config(2, "bf16")
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ValueError, match="parameter offload needs stage 3"):
        zeroshard.initialize(model=model, config=cfg)
    assert model.weight.dtype == torch.float32  # refused before the engine cast anything


def test_a_refused_config_leaves_the_model_as_it_was():
    run_distributed(refused_config_worker, 1)


def param_group_worker():
    import zeroshard
    model = nn.Linear(4, 2)
    cfg = _config(1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    engine, optimizer, *_ = zeroshard.initialize(model=model, config=cfg)
    # Groups are flattened and sharded at initialize: adding one later is refused, not half-done.
    with pytest.raises(ValueError, match="add_param_group: zeroshard's parameter groups are fixed"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    # A scheduler or script that writes a value of the wrong type is named by group and key.
    optimizer.param_groups[0]["nesterov"] = "yes"
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[\"nesterov\"\]: got 'yes', expected true or false"):
        engine.step()
    optimizer.param_groups[0]["nesterov"] = False
    optimizer.param_groups[0]["lr"] = [0.1]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[\"lr\"\]: got \[0.1\], expected a number"):
        engine.step()


def test_param_groups_are_fixed_at_initialize_and_their_values_checked():
    run_distributed(param_group_worker, 1)
