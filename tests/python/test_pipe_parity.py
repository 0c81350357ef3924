"""The numerics contract for pipelines: every schedule, at (2 stages x 2 data) and (4 stages x 1),
and every schedule but interleaving at (1 stage x 1), matches one process running the same layers
with torch.optim.AdamW on the same global batch (fp32: each step's loss and, after 10 steps, every
parameter of every stage within 1e-5 relative), with the embedding tied to the unembedding across
the first and last stage, gradient clipping that really clips, 4 micro-batches accumulated per
step, activation checkpointing (interval 2 and 1) in two of the schedules, and eval_batch's loss
and outputs afterwards (also over 3 micro-batches, a count that is no multiple of the stages). The model is built the way DeepSpeed pipeline scripts build theirs
(LayerSpec, TiedLayerSpec, loss_fn, seed_layers, initialize(model=net, model_parameters=[p for p in
net.parameters() if p.requires_grad])). bf16, and fp16 with dynamic loss scaling, at 2 stages x 1
data match the same fp32 reference within 16-bit roundoff (tolerance stated below). The parity runs
also run with NCCL's matching order for point-to-point transfers (in issue order, tags ignored)
over Gloo."""
import os

import pytest

from harness import run_distributed

STEPS = 10
MICRO = 2
GAS = 4
LR = 1e-2
TOL = 1e-5

# (schedule, virtual_stages, zero stage, clip, partition_method, activation_checkpoint_interval)
CASES = [
    ("gpipe", 1, 0, 0.5, "parameters", 0),
    ("1f1b", 1, 1, 0.5, "uniform", 2),
    ("interleaved_1f1b", 2, 1, 0.5, "parameters", 0),
    ("zero_bubble", 1, 0, 0.5, "type:block|embed", 1),
]


def _run(schedule, stages, virtual, zero_stage, clip, partition, interval, in_order, num_blocks=6):
    import torch
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import Reference, batches, layer_specs, loss_fn, rank_micro_batches

    world = int(os.environ["WORLD_SIZE"])
    dp = world // stages
    specs = layer_specs(num_blocks)
    net = PipelineModule(layers=specs, num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         partition_method=partition, virtual_stages=virtual,
                         activation_checkpoint_interval=interval)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": clip, "zero_optimization": {"stage": zero_stage},
        "pipeline": {"schedule": schedule, "virtual_stages": virtual}, "steps_per_print": 1000,
    }
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    # Two sides issuing a boundary's transfers in different orders swap or mismatch tensors here.
    engine._links.matches_in_order = in_order
    data = batches(STEPS, MICRO, GAS, dp, seed=7)
    it = rank_micro_batches(data, MICRO, GAS, engine.grid.get_data_parallel_id())
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(it)))
        norms.append(engine.get_global_grad_norm())

    device = engine.device  # the reference runs where the engine does (a GPU in test_cuda_engine.py)
    ref = Reference(specs).to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses, ref_norms = [], []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        ref_losses.append(float(loss))
    # eval_batch: the loss over a new batch (mean over micro-batches and data-parallel ranks) on
    # every rank, and the last stage's outputs of this data index's last micro-batch.
    d = engine.grid.get_data_parallel_id()
    (x, y), = batches(1, MICRO, GAS, dp, seed=11)
    loss, logits = engine.eval_batch(rank_micro_batches([(x, y)], MICRO, GAS, d), return_logits=True)
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        ref_eval = float(loss_fn(ref(x), y))
        lo = (d * GAS + GAS - 1) * MICRO
        ref_logits = ref(x[lo:lo + MICRO])
    eval_err = abs(float(loss) - ref_eval) / ref_eval
    # Fewer micro-batches than a step's, not a multiple of the stages: interleaving's last group
    # of micro-batches is short (its training order refuses such a count; eval's takes any).
    short = GAS - 1
    (x2, y2), = batches(1, MICRO, GAS, dp, seed=13)
    short_loss = float(engine.eval_batch(rank_micro_batches([(x2, y2)], MICRO, GAS, d), num_micro_batches=short))
    x2, y2 = x2.to(device), y2.to(device)
    with torch.no_grad():
        rows = [slice((i * GAS + k) * MICRO, (i * GAS + k + 1) * MICRO) for i in range(dp) for k in range(short)]
        ref_short = sum(float(loss_fn(ref(x2[r]), y2[r])) for r in rows) / len(rows)
    eval_err = max(eval_err, abs(short_loss - ref_short) / ref_short)
    holds_last = engine.module.stage_id == (engine.module.num_global_stages - 1) % stages
    logits_err = (float((logits - ref_logits).abs().max() / ref_logits.abs().max()) if holds_last
                  else (0.0 if logits is None else 1.0))
    param_err = {}
    for name, p in engine.module.named_parameters():
        r = ref.named(name).detach()
        param_err[name] = float((p.detach() - r).abs().max() / r.abs().max())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    return {"loss_err": loss_err, "norm_err": norm_err, "param_err": param_err,
            "eval_err": eval_err, "logits_err": logits_err,
            "clipped": ref_norms[0] > clip, "num_params": len(param_err), "device": str(device),
            "backend": torch.distributed.get_backend()}


def _cases(stages, in_order):
    out = {}
    for schedule, virtual, zero_stage, clip, partition, interval in CASES:
        if stages == 1 and virtual > 1:  # interleaving one stage is refused (test_pipe_errors.py)
            continue
        out[schedule] = _run(schedule, stages, virtual, zero_stage, clip, partition, interval, in_order)
    return out


@pytest.mark.parametrize("in_order", [False, True], ids=["matched-by-tag", "matched-in-order-as-nccl"])
@pytest.mark.parametrize("stages", [2, 4], ids=["2stages_x_2data", "4stages_x_1data"])
def test_every_schedule_matches_torch_optim(stages, in_order):
    results = run_distributed(_cases, 4, stages, in_order, timeout=240)
    for rank, by_schedule in enumerate(results):
        for schedule, r in by_schedule.items():
            _check(f"rank {rank} {schedule}", r)


def _check(where, r):
    assert r["clipped"], f"{where}: the reference's first gradient norm is under the clip"
    assert r["num_params"] > 0, f"{where}: the stage holds no parameters"
    assert r["loss_err"] <= TOL, f"{where}: loss differs by {r['loss_err']:.2e}"
    assert r["norm_err"] <= TOL, f"{where}: gradient norm differs by {r['norm_err']:.2e}"
    assert r["eval_err"] <= TOL, f"{where}: eval_batch loss differs by {r['eval_err']:.2e}"
    assert r["logits_err"] <= TOL, f"{where}: eval_batch logits differ by {r['logits_err']:.2e}"
    worst = max(r["param_err"], key=r["param_err"].get)
    assert r["param_err"][worst] <= TOL, f"{where}: {worst} differs by {r['param_err'][worst]:.2e}"


def test_one_stage_pipeline_matches_torch_optim():
    """num_stages=1 on a world of one: no transfers; gpipe, 1f1b and zero bubble (interleaving
    needs several stages) run their lists with ZeRO 0 or 1, clipping and checkpointing. The same
    run on a GPU with NCCL is test_cuda_engine.py's pipeline case."""
    results = run_distributed(_cases, 1, 1, True, timeout=240)[0]
    assert sorted(results) == ["1f1b", "gpipe", "zero_bubble"]
    for schedule, r in results.items():
        _check(f"rank 0 {schedule}", r)


# ----- 16-bit: bf16, and fp16 with dynamic loss scaling, at 2 stages x 1 data, 1f1b -----
# The model runs in 16 bits with fp32 master weights; the reference stays fp32. The tolerance is
# test_zero_parity.py's, for the same reason: bf16 keeps 8 significant bits (unit roundoff
# 2^-8 = 3.9e-3), so gradients differ from fp32 by about 1%, and Adam, which normalises every
# coordinate, turns that noise in tiny gradients into moves of up to lr: a worst-element bound
# would be meaningless. Each loss within 2e-2 relative (about 5 bf16 roundoffs), each gradient
# norm within 5e-2, and the rank's fp32 masters within 10% of the reference's total movement in
# L2 (||master - ref|| <= 0.1 ||ref - init||). A wrong stage, scale or step gives errors of order 1.
HALF_STEPS = 6
HALF_TOL = {"loss": 2e-2, "norm": 5e-2, "masters": 0.1}


def _half(precision):
    import torch
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import Reference, batches, layer_specs, loss_fn, rank_micro_batches

    specs = layer_specs(4)
    net = PipelineModule(layers=specs, num_stages=2, loss_fn=loss_fn, seed_layers=True, partition_method="uniform")
    ref = Reference(specs)
    initial = {n: ref.named(n).detach().clone() for n, _ in net.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
              # fp16 at 2^8: no overflow in these steps, so every step is taken at that scale.
              precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    data = batches(HALF_STEPS, MICRO, GAS, 1, seed=5)
    it = rank_micro_batches(data, MICRO, GAS, 0)
    got = [(float(engine.train_batch(it)), engine.get_global_grad_norm()) for _ in data]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        norm = torch.stack([p.grad.double().square().sum() for p in ref.parameters()]).sum().sqrt()
        opt.step()
        want.append((float(loss), float(norm)))
    core, names = engine._core, {id(p): n for n, p in engine.module.named_parameters()}
    masters = {names[id(engine._params[i])]: core.full_values.get(i, "fp32_param").float().reshape(-1)
               for i in range(core.num_params)}
    err = torch.cat([m - ref.named(n).detach().reshape(-1) for n, m in masters.items()]).norm()
    moved = torch.cat([(ref.named(n).detach() - initial[n]).reshape(-1) for n in masters]).norm()
    return {"losses": got, "ref": want, "masters": float(err / moved), "steps": engine.global_steps,
            "skipped": engine.skipped_steps, "scale": engine.get_loss_scale(),
            "dtype": str(next(engine.module.parameters()).dtype)}


def _halves():
    return {precision: _half(precision) for precision in ("bf16", "fp16")}


def test_bf16_and_fp16_pipelines_match_fp32_within_16_bit_roundoff():
    results = run_distributed(_halves, 2, timeout=180)
    for rank, by_precision in enumerate(results):
        for precision, r in by_precision.items():
            where = f"rank {rank} {precision}"
            assert r["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision], where
            assert r["steps"] == HALF_STEPS and r["skipped"] == 0, f"{where}: {r['steps']} steps, {r['skipped']} skipped"
            if precision == "fp16":
                assert r["scale"] == 2.0 ** 8, f"{where}: loss scale {r['scale']}"
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(r["losses"], r["ref"])):
                assert abs(loss - ref_loss) <= HALF_TOL["loss"] * ref_loss, f"{where} step {step}: loss {loss} vs {ref_loss}"
                assert abs(norm - ref_norm) <= HALF_TOL["norm"] * ref_norm, f"{where} step {step}: norm {norm} vs {ref_norm}"
            assert r["masters"] <= HALF_TOL["masters"], f"{where}: masters off by {r['masters']:.3f} of the movement"
