"""ZeRO-3 around the training loop: GatheredParameters (with a modifier rank), save_16bit_model,
and parameters used outside their own module (register_external_parameter)."""
import collections
import copy
import dataclasses
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import global_batch, tiny_gpt


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def gathered_worker():
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    engine, *_ = zeroshard.initialize(model=model, config=_config())
    weight, ref_weight = model.blocks[0].fc.weight, reference.blocks[0].fc.weight
    assert weight.numel() == 0                      # partitioned: nothing whole on any rank
    # DeepSpeed's attributes give the whole sizes meanwhile (peft counts parameters by ds_numel).
    assert weight.ds_shape == ref_weight.shape and weight.ds_numel == ref_weight.numel()
    assert sum(p.ds_numel for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert sorted(p.ds_id for p in model.parameters()) == list(range(len(list(reference.parameters()))))
    with GatheredParameters([weight]):
        assert torch.equal(weight, ref_weight)      # whole, and rank 0's initial values
    assert weight.numel() == 0                      # released again
    with GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)                   # only rank 0 edits
    with GatheredParameters(weight):
        assert torch.all(weight == 0.5)             # every rank sees rank 0's edit
    # The edit travels on the engine's communicator, numbered and named like its other collectives.
    assert "GatheredParameters: parameter" in engine._comm.recent_collectives()
    with GatheredParameters(weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                weight.fill_(0.25)
    with GatheredParameters(weight):
        assert torch.all(weight == 0.25)            # and from any rank
        with torch.no_grad():
            weight.fill_(0.5)                       # a block without modifier_rank keeps nothing
    with GatheredParameters(weight):
        assert torch.all(weight == 0.25)
    with pytest.raises(ValueError, match=r"modifier_rank=2\): expected None or a rank in 0..1"):
        GatheredParameters(weight, modifier_rank=2)
    with GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
    loss = engine(global_batch("gpt", 0, 4)[2 * rank:2 * rank + 2])
    engine.backward(loss)
    engine.step()                                   # training goes on from the edited values
    with GatheredParameters(weight):
        assert weight.shape == ref_weight.shape and not torch.all(weight == 0.5)


def test_gathered_parameters_and_modifier_rank():
    run_distributed(gathered_worker, 2)


def _with_reference(model, **zero):
    """A stage-3 engine around `model`, a whole torch copy of it and AdamW on the copy with the
    engine's settings (lr 1e-3, no weight decay)."""
    import zeroshard
    reference = copy.deepcopy(model)
    engine, *_ = zeroshard.initialize(model=model, config=_config(**zero))
    return engine, reference, torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)


def _reference_step(reference, optimizer, batch):
    """One torch step on the global batch: the mean over the two ranks' halves."""
    optimizer.zero_grad()
    for m in range(2):
        (reference(batch[2 * m:2 * m + 2]) / 2).backward()
    optimizer.step()


def _assert_matches(model, reference):
    from zeroshard.zero import GatheredParameters
    with GatheredParameters(list(model.parameters())):
        for a, b in zip(model.parameters(), reference.parameters()):
            assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def _arm_failure(module, message):
    """Makes module's forward raise `message` while the returned flag's [0] is True."""
    armed = [False]

    def fail_when_armed(module, args, out):
        if armed[0]:
            raise RuntimeError(message)
        return out
    module.register_forward_hook(fail_when_armed)
    return armed


def gathered_failed_forward_worker():
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    model = tiny_gpt()
    armed = _arm_failure(model.blocks[1], "injected forward failure")
    armed[0] = True
    engine, *_ = zeroshard.initialize(model=model, config=_config())
    weight = model.blocks[0].fc.weight
    batch = global_batch("gpt", 0, 4)[2 * rank:2 * rank + 2]
    with GatheredParameters(weight, modifier_rank=0):
        with pytest.raises(RuntimeError, match="injected forward failure"):
            engine(batch)
        assert weight.numel() > 0                   # the failed forward released only its own
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.25)
    assert engine._core.gatherer.live_gathered_numel == 0    # and the forward's gathers are gone
    armed[0] = False
    with GatheredParameters(weight):
        assert torch.all(weight == 0.25)
    engine.backward(engine(batch))
    engine.step()


def test_a_forward_that_raises_inside_gathered_parameters_keeps_the_block_gathered():
    run_distributed(gathered_failed_forward_worker, 2)


def save_worker(tmp, gather):
    import zeroshard
    from zeroshard.zero import GatheredParameters
    model = tiny_gpt()
    engine, *_ = zeroshard.initialize(
        model=model, config=_config(stage3_gather_16bit_weights_on_model_save=gather))
    wrote = engine.save_16bit_model(tmp)
    assert wrote == gather
    path = os.path.join(tmp, "pytorch_model.bin")
    assert os.path.exists(path) == gather
    if gather:
        saved = torch.load(path)
        with GatheredParameters(list(model.parameters())):
            for name, value in model.state_dict().items():
                assert torch.equal(saved[name], value), name


@pytest.mark.parametrize("gather", [True, False])
def test_save_16bit_model(tmp_path, gather):
    run_distributed(save_worker, 2, str(tmp_path), gather)


class SharedHead(nn.Module):
    """The output layer reuses the embedding's weight inside the parent's forward."""

    def __init__(self, register):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        if register:
            from zeroshard.zero import register_external_parameter
            register_external_parameter(self, self.emb.weight)

    def forward(self, batch):
        h = torch.tanh(self.mix(self.emb(batch[:, :-1])))
        logits = F.linear(h, self.emb.weight)
        return F.cross_entropy(logits.reshape(-1, 16), batch[:, 1:].reshape(-1))


def external_worker(register):
    rank = int(os.environ["RANK"])
    model = SharedHead(register)
    engine, reference, ref_opt = _with_reference(model)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        batch = torch.randint(0, 16, (4, 6), generator=g)
        loss = engine(batch[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        _reference_step(reference, ref_opt, batch)
    _assert_matches(model, reference)


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor

    def __post_init__(self):
        # Runs when the module builds it, and must not run again when the hooks rebuild it.
        self.second = self.second * 2


class Structured(nn.Module):
    """Returns its two products in the container named by `kind`; autograd must reach the
    module's _PreBackward through it, or its weight is still released when backward needs it."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        first, second = x @ self.a, torch.tanh(x @ self.b)
        if self.kind == "dict":
            return {"first": first, "rest": [second]}
        if self.kind == "namedtuple":
            return collections.namedtuple("Out", "first second")(first, second)
        return Pair(first, second)


class StructuredNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Structured(k) for k in ("dict", "namedtuple", "dataclass"))
        self.head = nn.Linear(8, 16)

    def forward(self, batch):
        h = self.emb(batch[:, :-1])
        for block in self.blocks:
            out = block(h)
            first, second = (out["first"], out["rest"][0]) if isinstance(out, dict) else \
                (out.first, out.second)
            h = torch.tanh(first + second)
        return F.cross_entropy(self.head(h).reshape(-1, 16), batch[:, 1:].reshape(-1))


def token_model_worker(model_class, seed):
    """Three stage-3 steps of model_class() (a loss over batches of 16-token sequences) at world
    2, against torch on the global batch."""
    rank = int(os.environ["RANK"])
    model = model_class()
    engine, reference, ref_opt = _with_reference(model)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        batch = torch.randint(0, 16, (4, 6), generator=g)
        engine.backward(engine(batch[2 * rank:2 * rank + 2]))
        engine.step()
        _reference_step(reference, ref_opt, batch)
    _assert_matches(model, reference)


def test_outputs_in_dicts_namedtuples_and_dataclasses_are_gathered_again_for_backward():
    run_distributed(token_model_worker, 2, StructuredNet, 7)


class ParameterContainers(nn.Module):
    """Parameters in a ParameterList and a ParameterDict (one nested in the other), read by
    the module that holds them: the containers never run a forward of their own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 12)
        self.layers = nn.ParameterList([nn.Parameter(torch.randn(12, 12) / 4) for _ in range(2)])
        self.extra = nn.ParameterDict({"scale": nn.Parameter(torch.ones(12)),
                                       "more": nn.ParameterList([nn.Parameter(torch.zeros(12))])})
        self.head = nn.Linear(12, 16)

    def forward(self, batch):
        h = self.embed(batch[:, :-1])
        for w in self.layers:
            h = torch.tanh(h @ w)
        h = h * self.extra["scale"] + self.extra["more"][0]
        return F.cross_entropy(self.head(h).reshape(-1, 16), batch[:, 1:].reshape(-1))


def test_parameters_in_parameter_lists_and_dicts_are_gathered_for_their_holder():
    run_distributed(token_model_worker, 2, ParameterContainers, 5)


def test_register_external_parameter():
    run_distributed(external_worker, 2, True)


def test_an_unregistered_external_parameter_is_gathered_by_the_reader():
    # Before issue 24 the read saw the empty partition and F.linear failed with a size mismatch.
    run_distributed(external_worker, 2, False)


# ----- the coordinator's trace: prefetch, reuse, the live cap, a changed order -----

def coordinator_worker(max_live, reuse, prefetch):
    import zeroshard
    rank = int(os.environ["RANK"])
    cfg = _config(stage3_max_live_parameters=max_live, stage3_max_reuse_distance=reuse,
                  stage3_prefetch_bucket_size=prefetch)
    model = tiny_gpt()
    module_numels = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    model_numel = sum(p.numel() for p in model.parameters())
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    peaks, after_forward, accounted = [], [], []
    for step in range(3):
        engine._core.gatherer.reset_gathered_peak()
        loss = engine(global_batch("gpt", step, 4)[2 * rank:2 * rank + 2])
        after_forward.append(engine._core.gatherer.live_gathered_numel)
        accounted.append(engine.memory_bytes()["gathered_parameters"])
        engine.backward(loss)
        engine.step()
        peaks.append(engine._core.gatherer.peak_gathered_numel)
    return {"peaks": peaks, "prefetched": engine._core.gatherer.prefetched_params,
            "invalid": engine._core.coordinator.trace_invalidations, "after_forward": after_forward,
            "accounted_bytes": accounted,
            "largest_module": max(module_numels), "model": model_numel}


def test_prefetch_follows_the_trace_within_the_live_cap():
    # Step 1 records the order (one module at a time); later steps prefetch along it.
    r, _ = run_distributed(coordinator_worker, 2, 2500, 0, 10 ** 6)
    assert r["prefetched"] > 0 and r["invalid"] == 0
    assert max(r["peaks"][1:]) <= 2500, r      # stage3_max_live_parameters holds
    assert r["peaks"][1] > r["peaks"][0], r    # prefetching gathers more than on demand


def test_prefetch_stays_within_its_bucket_ahead():
    # Without reuse, forward ends holding only the last module (its backward comes next) and at
    # most one bucket prefetched for backward; parameters already in flight count against the
    # bucket, or every fetch would start a bucket more and forward would end with all gathered.
    bucket = 1200  # holds the largest parameter (1024 elements), so prefetch is not stopped by it
    r, _ = run_distributed(coordinator_worker, 2, 10 ** 9, 0, bucket)
    assert r["prefetched"] > 0 and r["invalid"] == 0
    assert r["model"] > 2 * (bucket + r["largest_module"]), r  # the bound below means something
    assert max(r["after_forward"][1:]) <= bucket + r["largest_module"], r
    # The memory account shows prefetches in flight too (fp32: 4 bytes an element).
    assert r["accounted_bytes"] == [4 * n for n in r["after_forward"]], r


def test_no_prefetch_and_no_reuse_gather_on_demand_only():
    r, _ = run_distributed(coordinator_worker, 2, 10 ** 9, 0, 0)
    assert r["prefetched"] == 0 and r["peaks"][0] == r["peaks"][1] == r["peaks"][2], r


class Switchable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)
        self.skip_b = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if not self.skip_b:
            h = torch.tanh(self.b(h))
        return self.c(h).pow(2).mean()


def order_change_worker():
    import logging
    rank = int(os.environ["RANK"])
    warnings = []
    # The C++ runtime's warnings reach zeroshard's logger (runtime/log.h), not stderr directly.
    logging.getLogger("zeroshard").addHandler(logging.Handler())
    logging.getLogger("zeroshard").handlers[-1].emit = lambda record: warnings.append(record)
    model = Switchable()
    engine, reference, ref_opt = _with_reference(model)
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        # Every rank changes its module order at step 3: the trace must notice and re-record.
        model.skip_b = reference.skip_b = step >= 3
        batch = torch.randn(4, 6, generator=g)
        loss = engine(batch[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        for m in range(2):
            (reference(batch[2 * m:2 * m + 2]) / 2).backward()
        for p in reference.parameters():   # an unused layer still steps with a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
    assert engine._core.coordinator.trace_invalidations >= 1
    assert any(r.levelname == "WARNING" and f"rank {rank}: ZeRO-3 module order changed" in r.getMessage()
               for r in warnings)
    from zeroshard.zero import GatheredParameters
    with GatheredParameters(list(model.parameters())):
        for a, b in zip(model.parameters(), reference.parameters()):
            assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def test_a_changed_module_order_is_noticed_and_training_stays_exact():
    run_distributed(order_change_worker, 2)


# ----- forwards without gradients: evaluation between training steps -----

def eval_worker(evaluate):
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    model = tiny_gpt()
    armed = _arm_failure(model.blocks[1], "injected evaluation failure")
    engine, *_ = zeroshard.initialize(
        model=model, config=_config(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=2000))
    held, errors = [], []
    for step in range(6):
        loss = engine(global_batch("gpt", step, 4)[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        if not evaluate or step < 2:
            continue
        x = global_batch("gpt", 99, 4)[2 * rank:2 * rank + 2]
        engine.eval()
        with torch.no_grad():
            value = engine(x).item()
            armed[0] = step == 3                  # one evaluation forward raises half-way
            try:
                engine(x)
            except RuntimeError:
                assert armed[0]
            armed[0] = False
            held.append(engine._core.gatherer.live_gathered_numel)
            with GatheredParameters(list(model.parameters())):
                whole = {k: v.clone() for k, v in model.state_dict().items()}
            reference = tiny_gpt()
            reference.load_state_dict(whole)
            errors.append(abs(value - reference(x).item()) / abs(value))
        engine.train()
    return (engine._core.master(0).tolist(), engine._core.coordinator.trace_invalidations, held,
            engine._core.gatherer.prefetched_params, errors)


def test_evaluation_forwards_between_steps_keep_the_training_trace():
    # Forwards under torch.no_grad follow a trace of their own and release what they gathered
    # when they end: the training order is not disturbed (no re-recording, prefetch goes on),
    # nothing stays gathered, and training is bit for bit that of a run without evaluation.
    with_eval = run_distributed(eval_worker, 2, True)
    without = run_distributed(eval_worker, 2, False)
    for rank in range(2):
        master, invalidations, held, prefetched, errors = with_eval[rank]
        assert master == without[rank][0], f"rank {rank}: evaluation changed training"
        assert invalidations == 0 and held == [0] * 4, (invalidations, held)
        assert prefetched > without[rank][3], (prefetched, without[rank][3])
        assert max(errors) <= 1e-6, errors        # the whole model's output, from its chunks


# ----- activation checkpointing -----

class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            # The block itself is the region, as in most scripts: its forward's last saved
            # tensor ends the recomputation inside it.
            x = torch.tanh(checkpoint(block, x, use_reentrant=False))
        return self.head(x).pow(2).mean()


def checkpoint_worker():
    rank = int(os.environ["RANK"])
    model = Checkpointed()
    engine, reference, ref_opt = _with_reference(model, stage3_max_reuse_distance=0,
                                                 stage3_prefetch_bucket_size=0)
    peaks = []
    for step in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        loss = engine(x[2 * rank:2 * rank + 2])
        engine._core.gatherer.reset_gathered_peak()
        engine.backward(loss)
        peaks.append(engine._core.gatherer.peak_gathered_numel)
        engine.step()
        _reference_step(reference, ref_opt, x)
    _assert_matches(model, reference)
    return peaks


def test_non_reentrant_checkpointing_releases_the_recomputed_blocks():
    # The recomputation stops as soon as it has what backward needs, so a block's forward hook
    # after it never ran: its parameters stayed gathered until backward ended (all six blocks,
    # 6336 elements). The hook now runs however the forward ends.
    peaks = run_distributed(checkpoint_worker, 2)[0]
    assert max(peaks) <= 2 * (32 * 32 + 32) + 33, peaks


# ----- bench/zero3_single.py: the single-process run's prediction against the accounting -----

def test_single_process_prediction_equals_the_runtime_accounting(tmp_path):
    # The script the single-GPU run uses, at a small size on CPU (a world of one on Gloo): its
    # formula for the model-state bytes must equal the runtime's own accounting, at rest and at
    # the peak, with persistent (LayerNorm) and gathered parameters both present.
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "z3.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    subprocess.run([sys.executable, os.path.join(root, "bench", "zero3_single.py"), "--d-model", "64",
                    "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--micro", "2", "--steps", "3",
                    "--persistence", "100", "--prefetch", "5000", "--json", str(out)],
                   check=True, timeout=120, env=env, capture_output=True)
    r = json.loads(out.read_text())
    assert r["world"] == 1 and r["persistent_elements"] > 0 and r["gathered_peak_bytes"] > 0, r
    for row in r["rows"]:
        assert row["predicted"] == row["accounted"], row
    assert r["loss"][-1] < r["loss"][0], r["loss"]


# ----- empty_partition_cache (scripts call it after training, before offloading or deleting) -----

def empty_cache_worker(where, persistence=0):
    """Trains 4 steps; at step 2, `where` says what runs around one empty_partition_cache():
    "none" (no call), "lone" (after a forward no backward follows, then the call), "pending"
    (between a forward and its own backward), "held" (inside a GatheredParameters block, after a
    lone forward), "hook" (from a module's forward hook: an error). Records the elements whole
    (gathered, or persistent: below the threshold) before and after the call."""
    import zeroshard
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    cfg = _config(stage3_max_reuse_distance=10 ** 9, stage3_prefetch_bucket_size=10 ** 6,
                  stage3_param_persistence_threshold=persistence)
    model = tiny_gpt()
    out = {"persistent": sum(p.numel() for p in model.parameters() if p.numel() < persistence),
           "held": sum(p.numel() for p in model.blocks[0].parameters() if p.numel() >= persistence),
           "error": None}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    whole = lambda: sum(p.numel() for p in model.parameters())  # noqa: E731 - released ones hold 0
    for step in range(4):
        x = global_batch("gpt", step, 4)[2 * rank:2 * rank + 2]
        loss = None
        if step == 2 and where in ("lone", "held", "pending"):
            out["forward"] = engine(x)  # "pending": its backward follows below
            out["before"] = whole()
            with GatheredParameters(list(model.blocks[0].parameters()), enabled=where == "held"):
                engine.empty_partition_cache()
                out["after"] = whole()
            loss = out.pop("forward") if where == "pending" else None
        if step == 2 and where == "hook":
            handle = model.blocks[0].register_forward_hook(lambda *_: engine.empty_partition_cache())
            try:
                engine(x)
            except RuntimeError as error:
                out["error"] = str(error)
            handle.remove()
        loss = engine(x) if loss is None else loss
        engine.backward(loss)
        engine.step()
    out.pop("forward", None)
    out["invalidations"] = engine._core.coordinator.trace_invalidations
    out["masters"] = [engine._core.master(i).tolist() for i in range(len(engine.optimizer.param_groups))]
    return out


@pytest.mark.parametrize("persistence", [0, 64])
def test_empty_partition_cache_releases_what_nothing_holds(persistence):
    runs = {w: run_distributed(empty_cache_worker, 2, w, persistence)[0]
            for w in ("none", "lone", "pending", "held")}
    plain, lone, pending, held = runs["none"], runs["lone"], runs["pending"], runs["held"]
    keep = lone["persistent"]
    assert (keep > 0) == (persistence > 0)
    assert lone["before"] > keep, lone            # parameters kept for reuse after the lone forward
    assert lone["after"] == keep, lone            # all released but the persistent ones
    assert held["after"] == keep + held["held"], held  # and what the block holds
    assert pending["before"] > keep and pending["after"] == keep, pending
    # The same training whatever was released, and the fetch-order trace untouched by the call.
    assert plain["masters"] == lone["masters"] == pending["masters"] == held["masters"]
    assert pending["invalidations"] == plain["invalidations"], (pending, plain)


def test_empty_partition_cache_inside_a_forward_is_an_error():
    r = run_distributed(empty_cache_worker, 2, "hook")[0]
    assert "empty_partition_cache: called while a forward" in r["error"], r
