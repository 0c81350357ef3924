"""The engine's API and bookkeeping around the numerics: memory accounting, fp16 loss scaling,
param groups, client optimizers, schedulers, the data loader, errors, the log line."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from harness import NO_HOST_BYTES, run_distributed
from models import global_batch, tiny_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _base_config(**over):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    cfg.update(over)
    return cfg


# ----- initialize: every rank starts from rank 0's values -----

class _RankSeeded(torch.nn.Module):
    """A trainable layer, a frozen one and a buffer (a transposed view, not contiguous) whose
    values depend on the rank that builds them."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(rank)
        self.body = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6).requires_grad_(False)
        self.register_buffer("table", torch.randn(6, 4).t())

    def forward(self, x):
        return (self.frozen(torch.tanh(self.body(x))).sum(-1) + self.table.sum()).pow(2).mean()


def rank0_values_worker(stage):
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    expected = _RankSeeded(0).state_dict()
    model = _RankSeeded(rank)
    engine, *_ = zeroshard.initialize(model=model, config=_base_config(zero_optimization={"stage": stage}))
    recent = engine._comm.recent_collectives()
    with GatheredParameters(list(model.parameters())):
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), f"rank {rank}: {name}"
    return recent


@pytest.mark.parametrize("stage", [0, 3])
def test_every_rank_starts_from_rank_0s_parameters_and_buffers(stage):
    for recent in run_distributed(rank0_values_worker, 2, stage):
        # Frozen parameters and buffers go by the engine's communicator, named in its errors.
        assert "initial table" in recent and "initial frozen.weight" in recent, recent


# ----- stages 0/1: what param.grad holds when -----

class _LateUse(torch.nn.Module):
    """`late` gets a gradient only in the last micro-step of a window, `unused` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 6)
        self.late = torch.nn.Linear(6, 6)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x, last):
        h = torch.tanh(self.body(x))
        return ((self.late(h) if last else h) ** 2).mean()


def grad_lifecycle_worker(stage, gas, replace_grad):
    import torch.distributed as dist

    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = _LateUse()
    reference = copy.deepcopy(model)
    cfg = _base_config(gradient_accumulation_steps=gas, zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    params = dict(model.named_parameters())
    assert all(p.grad is None for p in params.values())
    for step in range(2):
        reference.zero_grad(set_to_none=False)
        for micro in range(gas):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
            last = micro == gas - 1
            if replace_grad and micro == 1:
                # A script may replace param.grad; the replacement is what accumulates from here.
                params["body.weight"].grad = params["body.weight"].grad.clone()
                reference.body.weight.grad = reference.body.weight.grad.clone()
            engine.backward(engine(x, last))
            (reference(x, last) / gas).backward()
            if not last:
                engine.step()  # a micro-step, as DeepSpeed scripts call it: no update yet
                assert params["body.weight"].grad is not None, "grads accumulate inside the window"
        expect = {}
        for name, p in reference.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            expect[name] = g / world
        for name, p in params.items():
            # Every parameter's gradient after the boundary backward is the mean over ranks and
            # micro-steps, zero for `unused`, and it views the flat buffer.
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, expect[name], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{name}, step {step}: {m}")
        engine.step()
        assert all(p.grad is None for p in params.values()), "step leaves param.grad None"
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                p.copy_(q)


@pytest.mark.parametrize("stage,gas,replace_grad,world", [(0, 1, False, 2), (1, 2, False, 2),
                                                           (0, 2, True, 2), (1, 1, False, 3)])
def test_stage0_1_param_grad_is_none_after_the_step_and_the_mean_after_backward(stage, gas,
                                                                               replace_grad, world):
    # World 3: 1/3 is not exact in binary, so the factor folded into the first copy is checked
    # against the reference's division after the sum within rounding.
    run_distributed(grad_lifecycle_worker, world, stage, gas, replace_grad)


# ----- memory: the runtime's own byte accounting -----

def memory_worker(stage, precision):
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    cfg = _base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 1000})
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    p = sum(t.numel() for t in model.parameters() if t.requires_grad)
    unit = world * 16
    ppad = (p + unit - 1) // unit * unit
    assert 0 <= ppad - p < unit
    half = 2 if precision == "bf16" else 4
    shard = ppad // world if stage >= 1 else ppad
    expect = {"parameters": half * ppad, "gradients": half * (shard if stage >= 2 else ppad),
              "master_weights": 4 * shard if precision == "bf16" else 0,
              "optimizer_state": 8 * shard, "gathered_parameters": 0, "comm_buffers": 0, **NO_HOST_BYTES}
    # The optimizer state is created by the first step (as torch.optim does), so that set-up never
    # holds it next to the caller's original parameters.
    got = engine.memory_bytes()
    assert got == dict(expect, optimizer_state=0), (got, expect)
    loss = engine(global_batch("gpt", 0, 2))
    engine.backward(loss)
    staged = engine.memory_bytes()["comm_buffers"]
    if stage == 2:
        # Staging buffers appear with the first backward: at most two buckets' worth.
        assert 0 < staged <= 2 * 2 * 1000, staged
    engine.step()
    got = dict(engine.memory_bytes(), comm_buffers=0)
    assert got == expect, (got, expect)
    state = sum(got.values())
    if stage == 1 and precision == "bf16":
        assert state == 4 * ppad + 12 * ppad // world  # 4P + 12P/N plus padding
    if stage == 2 and precision == "bf16":
        assert state == 2 * ppad + 14 * ppad // world  # 2P + 14P/N plus padding
    return got


@pytest.mark.parametrize("stage,precision,world", [(1, "bf16", 2), (1, "bf16", 4), (0, "bf16", 2),
                                                   (1, "fp32", 2), (2, "bf16", 2), (2, "bf16", 4)])
def test_model_state_bytes_match_the_formula(stage, precision, world):
    run_distributed(memory_worker, world, stage, precision)


def comm_dtype_memory_worker(stage):
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    cfg = _base_config(bf16={"enabled": True}, communication_data_type="fp32",
                       zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    p = sum(t.numel() for t in model.parameters())
    unit = world * 16
    return engine.memory_bytes()["comm_buffers"], p, (p + unit - 1) // unit * unit


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1])
def test_stage_0_1_account_the_communication_dtype_buffers(stage, world):
    # bf16 gradients reduced in fp32: every bucket has an fp32 copy of its gradients, held for the
    # run, so the comm buffers are 4 bytes per flat-buffer element the buckets span. A single
    # rank reduces nothing and makes no copy.
    buffers, p, ppad = run_distributed(comm_dtype_memory_worker, world, stage)[0]
    if world == 1:
        assert buffers == 0, buffers
    else:
        assert 4 * p <= buffers <= 4 * ppad, (buffers, p, ppad)


def zero3_memory_worker(threshold):
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    numels = [t.numel() for t in model.parameters()]
    cfg = _base_config(bf16={"enabled": True},
                       zero_optimization={"stage": 3, "reduce_bucket_size": 1000,
                                          "stage3_param_persistence_threshold": threshold})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    shard = sum((n + world - 1) // world for n in numels)       # this rank's chunks
    persistent = sum(n for n in numels if n < threshold)        # kept whole on every rank
    assert 0 <= shard * world - sum(numels) < world * len(numels)
    got = engine.memory_bytes()
    expect = {"parameters": 2 * shard + 2 * persistent, "gradients": 2 * shard,
              "master_weights": 4 * shard, "optimizer_state": 8 * shard,
              "gathered_parameters": 0, "comm_buffers": 0, **NO_HOST_BYTES}
    # The optimizer state comes with the first step; the gradient shard with each backward, and
    # it is freed again by the step.
    assert got == dict(expect, optimizer_state=0, gradients=0), (got, expect)
    peaks = []
    for step in range(2):
        loss = engine(global_batch("gpt", step, 2))
        peaks.append(engine._core.memory.peak_bytes()["gathered_parameters"])
        assert engine.memory_bytes()["gradients"] == 0
        engine.backward(loss)
        assert engine.memory_bytes()["gradients"] == 2 * shard
        engine.step()
    after = engine.memory_bytes()
    assert after["gathered_parameters"] == 0, after        # everything released after backward
    after["comm_buffers"] = 0
    assert after == dict(expect, gradients=0), (after, expect)
    peak = {k: v for k, v in engine._core.memory.peak_bytes().items()
            if k not in ("gathered_parameters", "comm_buffers")}
    # 16P/N (+ chunk padding) + persistent parameters, during backward and the step.
    assert peak == {k: v for k, v in expect.items() if k not in ("gathered_parameters", "comm_buffers")}, peak
    biggest = 2 * max(n for n in numels if n >= threshold)
    non_persistent = 2 * sum(n for n in numels if n >= threshold)
    # Module by module: never the whole model at once in forward, at least the largest tensor.
    assert biggest <= peaks[0] < non_persistent, (peaks, biggest, non_persistent)
    return peaks


@pytest.mark.parametrize("threshold,world", [(0, 2), (0, 4), (200, 2)])
def test_zero3_model_state_bytes_and_gathered_peak(threshold, world):
    run_distributed(zero3_memory_worker, world, threshold)


# ----- a forward or backward that raises -----

class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected backward failure")


def failed_backward_worker(stage, skipped, fail, where="backward"):
    import zeroshard
    rank = int(os.environ["RANK"])
    model = tiny_gpt()
    armed = [False]
    # A backward failure reaches backward after the later blocks, the final norm and the head
    # have their gradients, so some buckets are reduced, some filling and (overlap_comm) some in
    # flight. A forward failure comes after the embeddings and blocks[0] have been gathered.
    def fail_when_armed(module, args, out):
        if not armed[0]:
            return out
        if where == "forward":
            raise RuntimeError("injected forward failure")
        return _FailingBackward.apply(out)
    model.blocks[0].register_forward_hook(fail_when_armed)
    cfg = _base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 300, "overlap_comm": True,
                                          "stage3_param_persistence_threshold": 0})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    for step in range(5):
        if step == skipped and not fail:
            continue
        armed[0] = step == skipped
        batch = global_batch("gpt", step, 4)[2 * rank:2 * rank + 2]
        if armed[0] and where == "forward":
            with pytest.raises(RuntimeError, match="injected forward failure"):
                engine(batch)
            if stage == 3:
                assert engine._core.gatherer.live_gathered_numel == 0  # released, not left to the next backward
            continue
        loss = engine(batch)
        if armed[0]:
            with pytest.raises(RuntimeError, match="injected backward failure"):
                engine.backward(loss)
            engine.zero_grad()
            continue
        engine.backward(loss)
        engine.step()
    if stage == 3:
        # The failed iteration's partial order was not taken for the model's.
        assert engine._core.coordinator.trace_invalidations == 0
    return engine._core.master(0).tolist()  # plain floats: a tensor would be shared by file descriptor


@pytest.mark.parametrize("stage,where", [(0, "backward"), (1, "backward"), (2, "backward"),
                                         (3, "backward"), (1, "forward"), (3, "forward")])
def test_training_goes_on_after_a_forward_or_backward_that_raised(stage, where):
    # The failed micro-step's half-done reduction state is dropped and its gradients go with
    # zero_grad(); ZeRO-3 releases what was gathered. Training then matches a run that never saw
    # that batch, bit for bit.
    failed = run_distributed(failed_backward_worker, 2, stage, 1, True, where)
    skipped = run_distributed(failed_backward_worker, 2, stage, 1, False, where)
    for rank, (a, b) in enumerate(zip(failed, skipped)):
        a, b = torch.tensor(a), torch.tensor(b)
        assert torch.equal(a, b), f"rank {rank}: off by {(a - b).abs().max().item():.3e}"


# ----- fp16: dynamic loss scaling skips overflowing steps -----

def fp16_worker():
    import zeroshard
    model = tiny_gpt()
    cfg = _base_config(zero_optimization={"stage": 1},
                       fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    engine, opt, *_ = zeroshard.initialize(model=model, config=cfg)
    before = [p.detach().clone() for p in model.parameters()]
    scales, applied = [], []
    assert opt.overflow is False  # DeepSpeed's optimizers start with it False
    for step in range(30):
        batch = global_batch("gpt", step, 4)
        rank = int(os.environ["RANK"])
        loss = engine(batch[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        scales.append(engine.get_loss_scale())
        applied.append(engine.was_step_applied())
        assert opt.overflow is (not applied[-1])  # GPT-NeoX and Megatron read it every step
        if step == 0:
            # A skipped step leaves every parameter exactly as it was.
            assert not applied[0]
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            opt.load_state_dict(opt.state_dict())  # a load: no step of this run describes it yet
            assert opt.overflow is False and not engine.was_step_applied()
    assert scales[0] == 2.0 ** 39, scales[:3]                     # halved after the first overflow
    assert engine.skipped_steps == applied.count(False) > 0
    assert applied[-1] and scales[-1] < 2.0 ** 40
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.loss_scale == scales[-1]
    assert engine.get_global_grad_norm() is not None


def test_fp16_overflow_skips_steps_and_shrinks_the_scale():
    run_distributed(fp16_worker, 2)


# ----- param groups, client optimizers and schedulers against torch.optim -----

def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def wiring_worker(case):
    import torch.distributed as dist
    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    cfg = _base_config(zero_optimization={"stage": 1})
    if case == "param_groups":
        engine, *_ = zeroshard.initialize(model=model, model_parameters=_groups(model), config=cfg)
        ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3)
    elif case == "client_optimizer":
        del cfg["optimizer"]
        client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine, *_ = zeroshard.initialize(model=model, optimizer=client, config=cfg)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    elif case == "client_adam_decoupled":
        # torch.optim.Adam(decoupled_weight_decay=True) is AdamW, not L2-coupled Adam.
        del cfg["optimizer"]
        client = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1,
                                  decoupled_weight_decay=True)
        engine, *_ = zeroshard.initialize(model=model, optimizer=client, config=cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    elif case == "client_scheduler":
        # A torch scheduler built on the client optimizer must drive the engine's lr.
        del cfg["optimizer"]
        client = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 1.0 / (1 + s))
        engine, _, _, got = zeroshard.initialize(model=model, optimizer=client, lr_scheduler=sched,
                                                 config=cfg)
        assert got is sched
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    elif case == "scheduler_on_returned_optimizer":
        # The returned optimizer is a torch Optimizer, so a torch scheduler can wrap it.
        engine, opt, _, _ = zeroshard.initialize(model=model, config=cfg)
        assert isinstance(opt, torch.optim.Optimizer)
        engine.lr_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    else:  # scheduler from the config: the engine's lr drives the step it reports
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                             "warmup_num_steps": 5, "warmup_type": "linear"}}
        engine, _, _, sched = zeroshard.initialize(model=model, config=cfg)
        assert sched is engine.lr_scheduler and sched is not None
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    lrs = []
    for step in range(8):
        batch = global_batch("gpt", step, 2 * world)
        lr_now = engine.get_lr()
        lrs.append(lr_now[0])
        for g, lr in zip(ref_opt.param_groups, lr_now):
            g["lr"] = lr
        loss = engine(batch[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        for m in range(world):
            (ref(batch[2 * m:2 * m + 2]) / world).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    if case == "client_scheduler":
        assert lrs == pytest.approx([1e-3 / (1 + s) for s in range(8)])
    if case == "scheduler_on_returned_optimizer":
        assert lrs == pytest.approx([1e-3 * 0.5 ** (s // 2) for s in range(8)])
    if case == "scheduler":
        # The schedule drives the very first step (DeepSpeed runs that one at the optimizer's lr).
        assert lrs == pytest.approx([0.0, 0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])
    dist.barrier()


@pytest.mark.parametrize("case", ["param_groups", "client_optimizer", "client_adam_decoupled",
                                  "client_scheduler", "scheduler_on_returned_optimizer", "scheduler"])
def test_optimizer_wiring_matches_torch(case):
    run_distributed(wiring_worker, 2, case)


# ----- data loader, accumulation boundary -----

def loader_worker():
    import torch.distributed as dist
    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_gpt()
    data = torch.utils.data.TensorDataset(torch.arange(40))
    cfg = _base_config(train_batch_size=16, train_micro_batch_size_per_gpu=4)
    del cfg["gradient_accumulation_steps"]  # derived: 16 / (4 x 2)
    engine, _, loader, _ = zeroshard.initialize(model=model, config=cfg, training_data=data)
    assert engine.gradient_accumulation_steps() == 2  # 16 = 4 x 2 x world 2
    seen = torch.cat([b[0] for b in loader])
    assert all(b[0].numel() == 4 for b in loader) and len(loader) == 5
    everyone = [torch.zeros_like(seen) for _ in range(world)]
    dist.all_gather(everyone, seen)
    assert sorted(torch.cat(everyone).tolist()) == list(range(40))
    boundaries = []
    for step in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = engine(global_batch("gpt", step, 2))
        engine.backward(loss)
        engine.step()
    assert boundaries == [False, True, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 4
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()


def test_dataloader_shards_the_data_and_gas_boundaries():
    run_distributed(loader_worker, 2)


# ----- errors -----

def error_worker(config, expected):
    import zeroshard
    with pytest.raises(ValueError) as info:
        zeroshard.initialize(model=tiny_gpt(), config=config)
    assert str(info.value) == expected, str(info.value)


ERRORS = {
    "typo": ({"train_batch_size": 4, "gradient_clipp1ng": 1.0},
             'unknown key "gradient_clipp1ng"; did you mean "gradient_clipping"?'),
    "stage": ({"train_batch_size": 4, "zero_optimization": {"stage": 4}},
              "zero_optimization.stage: got 4, expected one of 0, 1, 2, 3"),
    "batch_arithmetic": ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                          "gradient_accumulation_steps": 1},
                         None),
    "offload_param_nvme_without_path": ({"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                         "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
                                        'zero_optimization.offload_param.nvme_path: missing, required when '
                                        'device is "nvme"'),
    "offload_param_below_stage_3": ({"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                     "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                                    'zero_optimization.offload_param.device: got "cpu" at stage 2; '
                                    'parameter offload needs stage 3 (only stage 3 partitions '
                                    'parameters, so only it can keep them off the device)'),
    "no_optimizer": ({"train_batch_size": 4},
                     'optimizer: none given; add an "optimizer" block to the config (e.g. {"type": '
                     '"AdamW", "params": {"lr": 1e-4}}) or pass initialize(optimizer=...)'),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_configs_get_exact_errors(name):
    config, expected = ERRORS[name]
    if name == "batch_arithmetic":
        expected = ("train_batch_size 32 != train_micro_batch_size_per_gpu 8 * "
                    "gradient_accumulation_steps 1 * data-parallel world size 2 = 16")
    run_distributed(error_worker, 2, config, expected)


# ----- a script with no launcher, and the progress line -----

SCRIPT = """
import sys, torch
sys.path.insert(0, {examples!r}); sys.path.insert(0, {tests!r})
import zeroshard
from models import tiny_gpt, global_batch
engine, *_ = zeroshard.initialize(model=tiny_gpt(), config={{
    "train_batch_size": 2, "steps_per_print": 2, "bf16": {{"enabled": True}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, "zero_optimization": {{"stage": 1}}}})
for step in range(4):
    loss = engine(global_batch("gpt", step, 2)); engine.backward(loss); engine.step()
print("world", engine.world_size, "steps", engine.global_steps)
"""


def test_a_script_without_a_launcher_runs_as_a_world_of_one_and_logs_progress():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    code = SCRIPT.format(examples=os.path.join(ROOT, "examples"),
                         tests=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world 1 steps 4" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("[zeroshard] step ")]
    assert [line.split()[2] for line in lines] == ["2", "4"], out.stdout
    for field in ("loss", "lr", "loss_scale", "samples/s", "parameters=", "gradients=",
                  "master_weights=", "optimizer_state="):
        assert field in lines[0], lines[0]


def _config_notes_worker():
    import logging

    import zeroshard
    from models import tiny_gpt

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zeroshard").addHandler(handler)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    cfg = _base_config(optimizer={"type": "AdamW", "legacy_fusion": True, "params": {"betas": "auto"}})
    zeroshard.initialize(model=tiny_gpt(), config=cfg)
    return [(r.levelname, r.getMessage()) for r in records if "legacy_fusion" in r.getMessage()
            or "auto" in r.getMessage()]


def test_config_warnings_are_logged_as_warnings_and_auto_resolutions_as_info():
    seen = run_distributed(_config_notes_worker, 1)[0]
    assert ("WARNING", "warning: optimizer.legacy_fusion: got true, accepted and ignored: zeroshard "
            "has one fp16 optimizer path") in seen, seen
    assert ("INFO", '"optimizer.params.betas": "auto" -> [0.9,0.999] (default)') in seen, seen
