"""ZeRO-3 with frozen parameters (requires_grad=False), as in LoRA-style fine-tuning: they are
partitioned and gathered like the trainable ones, released in backward once the nodes that could
read them have run (held until backward ends where that cannot be known), built under zero.Init
with adapters added outside it, and saved by save_16bit_model."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import NO_HOST_BYTES, run_distributed

D, V, RANK_R = 48, 24, 4


class LoraLinear(nn.Module):
    """peft's layout: the frozen base weight is this module's own parameter, beside a trainable
    bias, and the trainable low-rank adapters are child modules added later."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.bias = nn.Parameter(torch.zeros(d))
        # Trainable too: autograd finishes its gradient before the product's backward uses the
        # frozen weight, so that gradient must not be what releases the module.
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.lora_a = self.lora_b = None

    def add_adapters(self):
        self.lora_a = nn.Linear(self.d, RANK_R, bias=False)
        self.lora_b = nn.Linear(RANK_R, self.d, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale + self.bias + self.lora_b(self.lora_a(x))


class Proj(nn.Module):
    """(x @ W) * scale: mm saves the frozen Parameter itself for backward, not a view of it as
    linear does, and the trainable scale's gradient is final before mm's backward runs."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.scale = nn.Parameter(torch.linspace(1.5, 0.5, d))

    def forward(self, x):
        return (x @ self.weight) * self.scale


class FrozenBase(nn.Module):
    """Frozen modules whose input needs no gradient (emb), whose input does (mid, proj), one
    called twice (shared), and modules holding frozen and trainable parameters at once
    (block0/1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.inp = nn.Linear(D, D)
        self.block0 = LoraLinear(D)
        self.mid = nn.Linear(D, D)
        self.proj = Proj(D)
        self.shared = nn.Linear(D, D)
        self.block1 = LoraLinear(D)
        self.head = nn.Linear(D, V)

    def to_lora(self):
        """Freezes the base and adds the adapters, as peft's get_peft_model does."""
        for m in (self.emb, self.mid, self.shared):
            m.requires_grad_(False)
        self.proj.weight.requires_grad_(False)
        torch.manual_seed(1)
        for block in (self.block0, self.block1):
            block.weight.requires_grad_(False)
            block.add_adapters()
        return self

    def frozen_numel(self):
        return sum(p.numel() for p in self.parameters() if not p.requires_grad)

    def forward(self, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        h = torch.tanh(self.inp(self.emb(x)))
        h = torch.tanh(self.block0(h))
        h = torch.tanh(self.proj(torch.tanh(self.mid(h))))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.block1(h))
        h = torch.tanh(self.shared(h))
        return F.cross_entropy(self.head(h).reshape(-1, V), y.reshape(-1))


def _batch(step, size):
    return torch.randint(0, V, (size, 7), generator=torch.Generator().manual_seed(100 + step))


def _chunks(params, world):
    """Elements of this rank's chunks of `params` (every rank holds ceil(numel / world) each)."""
    return sum((p.numel() + world - 1) // world for p in params)


def frozen_worker(use_init, prefetch, save_dir):
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gas, micro, steps, lr = 2, 2, 10, 1e-3
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 500,
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0,
                                 "stage3_prefetch_bucket_size": prefetch,
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    reference = FrozenBase().to_lora()
    if use_init:
        # The base is partitioned while it is built; the adapters come after, whole.
        zeroshard.init_distributed()
        with zeroshard.zero.Init():
            model = FrozenBase()
        assert model.mid.weight.numel() == (D * D + world - 1) // world
        model.to_lora()
        params = [p for p in model.parameters() if p.requires_grad]  # as LoRA scripts pass them
    else:
        model = FrozenBase().to_lora()
        params = None
    frozen = [p for p in model.parameters() if not p.requires_grad]
    shard_t = _chunks([p for p in reference.parameters() if p.requires_grad], world)
    shard_f = _chunks([p for p in reference.parameters() if not p.requires_grad], world)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=params, config=cfg)
    # Partitioned: nothing whole on any rank, and the accounting holds this rank's chunks only
    # (fp32: no master copy; frozen parameters get no gradients or optimizer state).
    assert all(p.numel() == 0 for p in frozen)
    got = engine.memory_bytes()
    assert got["parameters"] == 4 * (shard_t + shard_f), (got, shard_t, shard_f)
    assert got["master_weights"] == 0 and got["gathered_parameters"] == 0, got

    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=lr,
                                weight_decay=0.0)
    forward_peaks, backward_peaks = [], []
    for step in range(steps):
        batch = _batch(step, micro * world * gas)
        losses = []
        for k in range(gas):
            start = (k * world + rank) * micro
            engine._core.gatherer.reset_gathered_peak()
            loss = engine(batch[start:start + micro])
            forward_peaks.append(engine._core.gatherer.peak_gathered_numel)
            losses.append(loss.item())
            engine._core.gatherer.reset_gathered_peak()
            engine.backward(loss)
            backward_peaks.append(engine._core.gatherer.peak_gathered_numel)
            engine.step()
        ref_opt.zero_grad()
        ref_losses = []
        for m in range(world * gas):
            ref_loss = reference(batch[m * micro:(m + 1) * micro])
            (ref_loss / (world * gas)).backward()
            ref_losses.append(ref_loss.item())
        ref_opt.step()
        for k in range(gas):
            r = ref_losses[k * world + rank]
            assert abs(losses[k] - r) <= 1e-5 * abs(r), (step, k, losses[k], r)
    assert engine.memory_bytes()["gathered_parameters"] == 0
    assert engine.memory_bytes()["optimizer_state"] == 8 * shard_t  # Adam: two fp32 states
    with GatheredParameters(list(model.parameters())):
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= 1e-5 * scale, f"rank {rank}: {name} off by {err:.3e} (scale {scale:.3e})"
            if not b.requires_grad:
                assert torch.equal(a, b), name  # frozen values never move
    engine.save_16bit_model(save_dir)
    engine.save_16bit_model(save_dir, "adapters.bin", exclude_frozen_parameters=True)
    return forward_peaks, backward_peaks, reference.frozen_numel()


@pytest.mark.parametrize("use_init,prefetch,world", [(False, 0, 2), (True, 3000, 2), (False, 3000, 4)],
                         ids=["whole-world2", "zero-init-prefetch-world2", "prefetch-world4"])
def test_frozen_parameters_are_partitioned_and_train_exactly(tmp_path, use_init, prefetch, world):
    results = run_distributed(frozen_worker, world, use_init, prefetch, str(tmp_path))
    forward_peaks, backward_peaks, frozen_numel = results[0]
    if prefetch == 0:
        # Forward and backward gather module by module: the frozen weights are never whole all
        # at once: 2592 gathered elements at most in either, of 12768 frozen ones (held until
        # backward ended, backward peaked at 14208).
        assert max(forward_peaks) < frozen_numel / 2, (forward_peaks, frozen_numel)
        assert max(backward_peaks) < frozen_numel / 2, (backward_peaks, frozen_numel)
    reference = FrozenBase().to_lora()
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert set(saved) == set(reference.state_dict())
    for name, p in reference.named_parameters():
        if not p.requires_grad:
            assert torch.equal(saved[name], p.detach()), name
    adapters = torch.load(tmp_path / "adapters.bin")
    assert set(adapters) == {n for n, p in reference.named_parameters() if p.requires_grad}


class _CtxLinear(torch.autograd.Function):
    """Keeps the weight on ctx as a Python object, as custom kernels' Functions often do: no
    reference autograd counts, so only the end of backward is sure to be past its use."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight, None


class KeepsAside(nn.Module):
    """Leaves a product with its frozen weight aside for the caller, as attention caches do: the
    node that saved the weight for it is not reachable from the module's output, and autograd
    runs it after every node that is."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5, requires_grad=False)
        self.kept = None

    def forward(self, x):
        self.kept = F.linear(x, self.weight) * 2
        return torch.tanh(F.linear(x, self.weight))


class OnChild(nn.Module):
    """The frozen weight is applied to a trainable child's output while the module's input needs
    no gradient: nothing about the inputs says when backward is done with the weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(D))
        self.adapter = nn.Linear(D, D)
        self.proj = Proj(D)
        self.proj.weight.requires_grad_(False)
        self.head = nn.Linear(D, 1)
        self.aside = KeepsAside()
        self.saves_in_ctx = self.checkpointed = self.keeps_aside = False

    def forward(self, x):
        h = self.adapter(x)
        h = _CtxLinear.apply(h, self.weight) if self.saves_in_ctx else F.linear(h, self.weight)
        h = torch.tanh(h + self.bias)
        if self.checkpointed:
            # tanh's backward inside the region recomputes it before proj is gathered for its
            # own backward, so mm's saved weight is read after the recomputing forward ended.
            from torch.utils.checkpoint import checkpoint
            h = checkpoint(lambda t: torch.tanh(self.proj(t)), h, use_reentrant=False)
        else:
            h = torch.tanh(self.proj(h))
        if self.keeps_aside:
            h = self.aside(h)
            return self.head(h).pow(2).mean() + self.aside.kept.pow(2).mean()
        return self.head(h).pow(2).mean()


def _on_demand_engine(model, watched):
    """A whole reference copy of `model`, a stage-3 engine that gathers on demand only (no
    prefetch, reuse or persistence) and does not move parameters (lr 0), and the list that
    collects the gradients of `model.<watched>.weight`."""
    import copy

    import zeroshard
    reference = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    seen = []
    weight = getattr(model, watched).weight
    weight.register_hook(lambda g: seen.append(g.clone()))  # before C++ takes it
    return model, reference, engine, seen


def graph_reuse_worker(case):
    """Gradients reaching the trainable parameters when backward runs more than once over one
    forward's graph (retain_graph), over two forwards' graphs, or past a frozen weight applied
    to a child's output, against plain autograd on a whole copy."""
    if case == "gradient-penalty":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D, bias=False), nn.Tanh(),
                            nn.Linear(D, 1))
        net[2].weight.requires_grad_(False)
        model, reference, engine, seen = _on_demand_engine(net, "0")
        target = reference[0].weight
    else:
        model, reference, engine, seen = _on_demand_engine(OnChild(), "adapter")
        target = reference.adapter.weight
    engine.set_gradient_accumulation_boundary(False)
    x1, x2 = (torch.randn(2, D, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    if case == "retain-graph":
        loss = engine(x1)
        engine.backward(loss, retain_graph=True, scale_wrt_gas=False)
        engine.backward(2 * loss, scale_wrt_gas=False)
        ref = reference(x1)
        want = [torch.autograd.grad(ref, target, retain_graph=True)[0],
                torch.autograd.grad(2 * ref, target)[0]]
    elif case == "two-forwards":
        first, second = engine(x1), engine(x2)
        engine.backward(first, scale_wrt_gas=False)
        engine.backward(second, scale_wrt_gas=False)
        want = [torch.autograd.grad(reference(x), target)[0] for x in (x1, x2)]
    elif case == "gradient-penalty":
        # After a backward that kept the graph, autograd.grad(create_graph=True) outside the
        # engine's backward runs the frozen module's nodes again and builds new ones that read
        # its weight in the next backward.
        def two_backwards(model, x, backward):
            x = x.clone().requires_grad_()
            loss = model(x).pow(2).mean()
            first = backward(loss)
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            return [first, backward(g.pow(2).sum())]
        two_backwards(engine, x1, lambda loss: engine.backward(loss, retain_graph=True,
                                                                scale_wrt_gas=False))
        want = two_backwards(reference, x1,
                             lambda loss: torch.autograd.grad(loss, target, retain_graph=True)[0])
    elif case in ("saved-by-python", "checkpointed", "kept-aside"):
        flag = {"saved-by-python": "saves_in_ctx", "kept-aside": "keeps_aside"}.get(case, case)
        setattr(model, flag, True)
        setattr(reference, flag, True)
        engine.backward(engine(x1), scale_wrt_gas=False)
        want = [torch.autograd.grad(reference(x1), target)[0]]
    else:
        engine.backward(engine(x1), scale_wrt_gas=False)
        want = [torch.autograd.grad(reference(x1), target)[0]]
    assert len(seen) == len(want)
    return [(g - w).abs().max().item() for g, w in zip(seen, want)]


@pytest.mark.parametrize("case", ["retain-graph", "two-forwards", "weight-on-child-output",
                                  "saved-by-python", "checkpointed", "kept-aside",
                                  "gradient-penalty"])
def test_frozen_weights_stay_gathered_while_backward_still_reads_them(case):
    # Releases keyed to the inputs' gradients, or to reference counts on the gathered values,
    # freed the weight in the first five cases while a node still had it saved (an error, or
    # gradients read from freed memory); one keyed to the nodes reachable from the module's
    # outputs alone frees it in kept-aside, and one armed outside the engine's backward in
    # gradient-penalty.
    for errors in run_distributed(graph_reuse_worker, 2, case):
        assert errors and max(errors) == 0.0, errors


def bf16_memory_worker():
    import zeroshard
    world = int(os.environ["WORLD_SIZE"])
    model = FrozenBase().to_lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    shard_t, shard_f = _chunks(trainable, world), _chunks(frozen, world)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    losses = []
    for step in range(3):
        loss = engine(_batch(step, 2))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    got = engine.memory_bytes()
    # 16 bytes per trainable element over N (bf16 parameters, fp32 master and Adam state; the
    # gradient shard is freed by the step) and 2 per frozen one.
    expect = {"parameters": 2 * (shard_t + shard_f), "gradients": 0, "master_weights": 4 * shard_t,
              "optimizer_state": 8 * shard_t, "gathered_parameters": 0, "comm_buffers": 0, **NO_HOST_BYTES}
    got["comm_buffers"] = 0
    assert got == expect, (got, expect)
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_frozen_parameters_cost_two_bytes_over_n_in_bf16():
    run_distributed(bf16_memory_worker, 2)


class CheckpointedLora(nn.Module):
    """Six LoRA blocks over a frozen base, each under activation checkpointing, as fine-tuning
    a large model with gradient checkpointing runs; with `shared`, a frozen Proj is applied in
    every region too (a module with several forwards in one iteration)."""

    def __init__(self, reentrant, shared=False):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.shared = Proj(D) if shared else None
        if shared:
            # Wholly frozen: reentrant checkpointing runs a backward per region, so a trainable
            # parameter used in several regions gets several gradients in one backward, which
            # the gradient reducers refuse (as DeepSpeed does).
            self.shared.requires_grad_(False)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(LoraLinear(D) for _ in range(6))
        for block in self.blocks:
            block.weight.requires_grad_(False)
            block.add_adapters()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = self.inp(x)
        for block in self.blocks:
            region = (lambda t, b=block: torch.tanh(b(t))) if self.shared is None else \
                (lambda t, b=block: torch.tanh(self.shared(b(t))))
            h = checkpoint(region, h, use_reentrant=self.reentrant)
        return self.head(h).pow(2).mean()


def checkpointed_lora_worker(reentrant, shared):
    model, reference, engine, seen = _on_demand_engine(CheckpointedLora(reentrant, shared), "inp")
    errors, peaks = [], []
    for step in range(3):
        x = torch.randn(2, D, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine._core.gatherer.reset_gathered_peak()
        engine.backward(loss, scale_wrt_gas=False)
        peaks.append(engine._core.gatherer.peak_gathered_numel)
        engine.step()
        reference.zero_grad()
        reference(x).backward()  # reentrant checkpointing refuses autograd.grad
        errors.append((seen[-1] - reference.inp.weight.grad).abs().max().item())
    frozen = sum(p.numel() for p in reference.parameters() if not p.requires_grad)
    return errors, max(peaks), frozen


@pytest.mark.parametrize("reentrant,shared", [(True, False), (False, False), (True, True),
                                               (False, True)],
                         ids=["reentrant", "non-reentrant", "reentrant-shared",
                              "non-reentrant-shared"])
def test_checkpointed_lora_blocks_give_exact_gradients(reentrant, shared):
    for errors, peak, frozen in run_distributed(checkpointed_lora_worker, 2, reentrant, shared):
        assert len(errors) == 3 and max(errors) == 0.0, errors
        if not shared:
            # Each recomputed block is released once the nodes reading what it saved have run:
            # 2592 gathered elements at most, of 13824 frozen ones (16752 when held until
            # backward ends, as a module with several forwards still is under non-reentrant
            # checkpointing; see the README).
            assert peak < frozen / 2, (peak, frozen)


class Tower(nn.Module):
    """A frozen product whose output is rescaled in place through a slice when the batch's mean is
    positive: the in-place write hides a node from the walk (CopySlices), so whether this forward
    can be tracked depends on the data, which differs between ranks."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5, requires_grad=False)

    def forward(self, x):
        y = x @ self.weight
        if x.detach().mean() > 0:
            y = y.clone()
            y[:, :2] = y[:, :2] * 0.5
        return y


class TwoTowers(nn.Module):
    """The tower applied twice, plainly or each time under reentrant checkpointing (whose first
    forward builds no graph: the recomputations inside backward are what is tracked)."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.adapter, self.tower, self.head = nn.Linear(D, D), Tower(), nn.Linear(D, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        if self.reentrant:
            a = checkpoint(self.tower, self.adapter(x[0]), use_reentrant=True)
            b = checkpoint(self.tower, self.adapter(x[1]) + a, use_reentrant=True)
        else:
            a, b = self.tower(self.adapter(x[0])), self.tower(self.adapter(x[1]))
        return self.head(torch.tanh(a * b)).pow(2).mean()


def divergent_graphs_worker(reentrant):
    rank = int(os.environ["RANK"])
    model, reference, engine, seen = _on_demand_engine(TwoTowers(reentrant), "adapter")
    sign = 1.0 if rank == 0 else -1.0  # only rank 0's batch takes the branch
    x = sign * 50 * torch.randn(2, 2, D, generator=torch.Generator().manual_seed(7)).abs()
    engine.backward(engine(x), scale_wrt_gas=False)
    reference.zero_grad()
    reference(x).backward()  # reentrant checkpointing refuses autograd.grad
    return (seen[0] - reference.adapter.weight.grad).abs().max().item()


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant-checkpointed"])
def test_ranks_whose_graphs_differ_hold_the_same_frozen_modules(reentrant):
    # Rank 1 could release the tower after its second forward's nodes and all-gather it again for
    # the first while rank 0, which cannot track them, holds it and issues no all-gather: the
    # ranks compare which forwards they track at the start of backward (a recomputation inside
    # backward, when it ends), and hold all if they differ.
    for error in run_distributed(divergent_graphs_worker, 2, reentrant, timeout=60):
        assert error == 0.0
