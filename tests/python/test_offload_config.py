"""The offload config as a user writes it (issue 19): what is refused and what the message says,
DeepSpeed's zero_force_ds_cpu_optimizer rule for client optimizers, the zeroshard.ops (DeepSpeed
CPU) optimizers, and pin_memory on a CPU-only run."""
import copy
import os

import pytest
import torch

from harness import run_distributed
from models import global_batch, tiny_gpt
from test_zero_parity import Lion

OFFLOADABLE = ("Adam", "AdamW", "Adagrad", "Lion", "SGD")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
LAMB = {"type": "Lamb", "params": {"lr": 1e-3}}


def _config(stage=2, offload_optimizer=True, offload_param=False, optimizer=ADAMW, **block):
    """A config with the offload blocks asked for (True: {"device": "cpu"}; a dict: that block);
    `optimizer` None leaves the optimizer block out (the script passes its own); `block` adds
    zero_optimization keys."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    for key, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value:
            zero[key] = value if isinstance(value, dict) else {"device": "cpu"}
    zero.update(block)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "zero_optimization": zero}
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    return cfg


# ----- what initialize refuses, and what it says -----

REFUSED = {
    # Parameter offload moves ZeRO-3's chunks; below stage 3 there are none.
    # Optimizer offload moves a rank's shard of the optimizer; stage 0 has none.
    "offload_optimizer-stage0": (_config(0), ("offload_optimizer", "stage 0", "stage 1, 2 or 3")),
    "offload_param-stage0": (_config(0, offload_optimizer=False, offload_param=True),
                             ("offload_param", "stage 3")),
    "offload_param-stage1": (_config(1, offload_optimizer=False, offload_param=True),
                             ("offload_param", "stage 3")),
    "offload_param-stage2": (_config(2, offload_param=True), ("offload_param", "stage 3")),
    # Lamb's per-tensor trust ratio has no offloaded form, with either offload block.
    "lamb-offload_param": (_config(3, optimizer=LAMB, offload_optimizer=False, offload_param=True),
                           ("Lamb", "offload_param") + OFFLOADABLE),
    # The host step runs on the fused CPU kernels; Lamb has none.
    "lamb": (_config(2, optimizer=LAMB), ("Lamb", "offload_optimizer") + OFFLOADABLE),
    "lamb-partial": (_config(3, optimizer=LAMB, offload_optimizer={"device": "cpu", "ratio": 0.4}),
                     ("Lamb",) + OFFLOADABLE),
    "ratio-above-1": (_config(2, offload_optimizer={"device": "cpu", "ratio": 1.5}),
                      ("offload_optimizer", "ratio", "1.5")),
    # Parameters on NVMe: stage 3 only (they run there: test_nvme_*.py).
    "nvme-param-stage2": (_config(2, offload_optimizer=False, offload_param={"device": "nvme", "nvme_path": "/tmp"}),
                          ("offload_param", "nvme", "stage 2", "needs stage 3")),
    "nvme-stage0": (_config(0, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
                    ("offload_optimizer", "nvme", "stage 1, 2 or 3")),
    "nvme-lamb": (_config(2, optimizer=LAMB, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
                  ("Lamb", "offload_optimizer", "nvme") + OFFLOADABLE),
}


def refused_worker(config, needles):
    import zeroshard
    with pytest.raises(ValueError) as info:
        zeroshard.initialize(model=tiny_gpt(), config=config)
    message = str(info.value)
    missing = [n for n in needles if n not in message]
    assert not missing, f"the message does not name {missing}: {message}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_offload_configs_that_cannot_run_are_refused_with_a_reason(name):
    config, needles = REFUSED[name]
    run_distributed(refused_worker, 1, config, needles)


# ----- client optimizers: DeepSpeed's zero_force_ds_cpu_optimizer -----

def _client(name, params):
    """The optimizer a script builds, and the torch reference that makes the same update."""
    from zeroshard.ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion
    params = list(params)
    if name == "torch.AdamW":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "DeepSpeedCPUAdam":
        return DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01)  # adamw_mode=True: AdamW
    if name == "DeepSpeedCPUAdagrad":
        return DeepSpeedCPUAdagrad(params, lr=1e-2, weight_decay=0.01)
    if name == "DeepSpeedCPULion":
        return DeepSpeedCPULion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    raise AssertionError(name)


def _reference(name, params):
    if name in ("torch.AdamW", "DeepSpeedCPUAdam"):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "DeepSpeedCPUAdagrad":
        return torch.optim.Adagrad(params, lr=1e-2, weight_decay=0.01)
    if name == "DeepSpeedCPULion":
        return Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    raise AssertionError(name)


def _reference_step(reference, optimizer, batch, world, clip):
    """One torch step on the global batch: the mean over the ranks' micro-batches, clipped."""
    optimizer.zero_grad()
    for r in range(world):
        (reference(batch[2 * r:2 * r + 2]) / world).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    optimizer.step()


def _assert_matches(model, reference):
    from zeroshard.zero import GatheredParameters
    with GatheredParameters(list(model.parameters())):
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            err, scale = (a.detach() - b.detach()).abs().max().item(), b.detach().abs().max().item()
            assert err <= 1e-5 * scale, f"{name}: off by {err:.3e} (scale {scale:.3e})"


def client_worker(name, stage, force):
    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    config = _config(stage, offload_param=stage == 3, optimizer=None)
    if force is not None:
        config["zero_force_ds_cpu_optimizer"] = force
    optimizer = _client(name, model.parameters())
    if name.startswith("torch.") and force in (None, True):
        with pytest.raises(ValueError) as info:
            zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        message = str(info.value)
        for needle in ("zero_force_ds_cpu_optimizer", "DeepSpeedCPUAdam"):
            assert needle in message, f"the message does not name {needle}: {message}"
        return
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    ref_opt = _reference(name, reference.parameters())
    for step in range(4):
        batch = global_batch("gpt", step, 2 * world)
        engine.backward(engine(batch[2 * rank:2 * rank + 2]))
        engine.step()
        _reference_step(reference, ref_opt, batch, world, config["gradient_clipping"])
    _assert_matches(model, reference)
    got = engine.memory_bytes()
    assert got["master_weights"] == got["optimizer_state"] == 0, got
    assert got["host_master_weights"] > 0 and got["host_optimizer_state"] > 0, got


CLIENTS = [
    # A torch optimizer with offload: refused by default (DeepSpeed's rule), and when the switch
    # is set to true; run on the CPU kernels when it is false.
    ("torch.AdamW", 2, 1, None),
    ("torch.AdamW", 2, 1, True),
    ("torch.AdamW", 2, 2, False),
    ("torch.AdamW", 3, 2, False),
    # DeepSpeed's CPU optimizers are what the rule asks for: accepted as they are.
    ("DeepSpeedCPUAdam", 2, 2, None),
    ("DeepSpeedCPUAdam", 3, 2, True),
    ("DeepSpeedCPUAdagrad", 1, 2, None),
    ("DeepSpeedCPULion", 2, 2, None),
]


def clients_worker(cases):
    """The cases of one world size in one set of rank processes; a failure names its case."""
    for name, stage, _, force in cases:
        try:
            client_worker(name, stage, force)
        except Exception as e:
            raise AssertionError(f"{name} at stage {stage}, zero_force_ds_cpu_optimizer {force}: {e}") from e


@pytest.mark.parametrize("world", sorted({c[2] for c in CLIENTS}))
def test_client_optimizers_with_offload_follow_zero_force_ds_cpu_optimizer(world):
    run_distributed(clients_worker, world, [c for c in CLIENTS if c[2] == world])


def no_offload_client_worker():
    import zeroshard
    model = tiny_gpt()
    config = _config(2, offload_optimizer=False, optimizer=None)
    # The rule is about offload only: without it a torch optimizer runs as before.
    zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         config=config)


def test_a_torch_optimizer_without_offload_is_not_refused():
    run_distributed(no_offload_client_worker, 1)


# ----- a DeepSpeed script, as written for DeepSpeed, with pinned memory on a CPU-only run -----

def deepspeed_script_worker():
    import zeroshard
    rank = int(os.environ["RANK"])
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    }
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)

    model_engine, optimizer, _, _ = zeroshard.initialize(model=model,
                                                         model_parameters=model.parameters(),
                                                         config=ds_config)
    for step in range(4):
        batch = global_batch("gpt", step, 4)
        loss = model_engine(batch[2 * rank:2 * rank + 2])
        model_engine.backward(loss)
        model_engine.step()
        _reference_step(reference, ref_opt, batch, 2, 1.0)

    # There is nothing to pin for on the CPU; pin_memory asks for it and the run goes on the same.
    _assert_matches(model, reference)
    got = model_engine.memory_bytes()
    assert got["parameters"] == 0 and got["host_parameters"] > 0, got
    assert model_engine.global_steps == 4 and optimizer.param_groups[0]["lr"] == 1e-3


def test_a_deepspeed_script_with_pinned_offload_trains_on_a_cpu_only_run():
    run_distributed(deepspeed_script_worker, 2)


def deprecated_cpu_offload_worker():
    import zeroshard
    # DeepSpeed's old spelling of offload_optimizer (read with a warning).
    config = _config(2, offload_optimizer=False, cpu_offload=True)
    model = tiny_gpt()
    engine, *_ = zeroshard.initialize(model=model, config=config)
    engine.backward(engine(global_batch("gpt", 0, 2)))
    engine.step()
    got = engine.memory_bytes()
    assert got["optimizer_state"] == 0 and got["host_optimizer_state"] > 0, got


def test_the_deprecated_cpu_offload_switch_offloads_the_optimizer():
    run_distributed(deprecated_cpu_offload_worker, 1)
