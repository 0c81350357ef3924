"""PipelineModule(dynamic_shape=True), DeepSpeed's, as its variable batch size and sequence length
example uses it: micro-batches whose rows and length change from micro-batch to micro-batch, from
step to step and from one data-parallel replica to the other, through every schedule, at 2 stages
x 1 and x 2 data, with a plain tensor and with a (hidden, bool mask) tuple at the boundaries, by
tag and in NCCL's matching order; training, eval_batch's loss and its per-micro-batch outputs all
match one process. And eval_batch's average of outputs whose shapes differ is refused by name."""
import os

import pytest
import torch

from harness import run_distributed

MICRO, GAS = 2, 4
# Per data index: (rows, tokens) of each micro-batch; each step rotates them by one, so a layout
# kept from an earlier step's micro-batch of the same index would be wrong.
SHAPES = {0: [(2, 8), (2, 5), (1, 7), (2, 3)], 1: [(1, 4), (2, 9), (2, 2), (1, 6)]}
STEPS = 3


def _model(masked):
    from pipe_models import VOCAB, layer_specs, loss_fn
    if not masked:
        return layer_specs(4), loss_fn, VOCAB
    from zeroshard.pipe import LayerSpec
    from pipe_models import MASKED_VOCAB, MaskedBlock, MaskedEmbed, MaskedLMHead, masked_loss
    return ([LayerSpec(MaskedEmbed)] + [LayerSpec(MaskedBlock) for _ in range(4)] + [LayerSpec(MaskedLMHead)],
            masked_loss, MASKED_VOCAB)


def _steps(dp, vocab):
    g = torch.Generator().manual_seed(9)
    out = []
    for k in range(STEPS):
        per_replica = []
        for d in range(dp):
            shapes = SHAPES[d][k % GAS:] + SHAPES[d][:k % GAS]
            tokens = [torch.randint(0, vocab, (rows, seq + 1), generator=g) for rows, seq in shapes]
            per_replica.append([(t[:, :-1], t[:, 1:]) for t in tokens])
        out.append(per_replica)
    return out


def _worker(schedule, virtual, in_order, masked):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import Reference
    dp = int(os.environ["WORLD_SIZE"]) // 2
    specs, loss_fn, vocab = _model(masked)
    net = PipelineModule(layers=specs, num_stages=2, loss_fn=loss_fn, seed_layers=True, partition_method="uniform",
                         virtual_stages=virtual, dynamic_shape=True)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "steps_per_print": 1000,
              "pipeline": {"schedule": schedule, "virtual_stages": virtual}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine._links.matches_in_order = in_order  # NCCL's matching order, over Gloo
    steps = _steps(dp, vocab)
    d = engine.grid.get_data_parallel_id()
    losses = [float(engine.train_batch(iter(step[d]))) for step in steps]
    evaluated = float(engine.eval_batch(iter(steps[1][d])))  # another order of shapes than step 0's
    outputs = engine.eval_batch(iter(steps[1][d]), compute_loss=False, reduce_output=None)

    ref = Reference(specs)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for step in steps:
        opt.zero_grad()
        loss = sum(loss_fn(ref(x), y) for replica in step for x, y in replica) / (GAS * dp)
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
    with torch.no_grad():
        ref_eval = float(sum(loss_fn(ref(x), y) for replica in steps[1] for x, y in replica) / (GAS * dp))
        ref_outputs = [ref(x) for x, _ in steps[1][d]]
    param_err = max(float((p.detach() - ref.named(name)).abs().max() / ref.named(name).abs().max())
                    for name, p in engine.module.named_parameters())
    loss_err = max(abs(a - b) / b for a, b in zip(losses + [evaluated], ref_losses + [ref_eval]))
    holds_last = engine.is_last_stage()
    output_err = (max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(outputs, ref_outputs))
                  if holds_last else (0.0 if outputs is None else 1.0))
    return {"loss_err": loss_err, "param_err": param_err, "output_err": output_err,
            "output_shapes": [list(o.shape) for o in outputs] if holds_last else None}


@pytest.mark.parametrize("world,schedule,virtual,in_order,masked", [
    (2, "1f1b", 1, True, False),
    (2, "interleaved_1f1b", 2, True, True),
    (2, "zero_bubble", 1, False, False),
    (4, "gpipe", 1, False, False),
    (4, "1f1b", 1, False, True),
    (4, "interleaved_1f1b", 2, False, False),
    (4, "interleaved_1f1b", 2, True, False),
    (4, "zero_bubble", 1, True, True),
], ids=["2x1-1f1b-in_order", "2x1-interleaved-in_order-mask", "2x1-zero_bubble", "2x2-gpipe", "2x2-1f1b-mask",
        "2x2-interleaved", "2x2-interleaved-in_order", "2x2-zero_bubble-in_order-mask"])
def test_micro_batches_of_changing_shapes_train_as_one_process(world, schedule, virtual, in_order, masked):
    for rank, r in enumerate(run_distributed(_worker, world, schedule, virtual, in_order, masked, timeout=180)):
        assert r["loss_err"] <= 1e-5, (rank, r)
        assert r["param_err"] <= 1e-5, (rank, r)
        assert r["output_err"] <= 1e-5, (rank, r)
        if r["output_shapes"] is not None:  # the last stage's: each micro-batch's own
            d = rank % (world // 2)
            rotated = SHAPES[d][1:] + SHAPES[d][:1]
            assert [s[:2] for s in r["output_shapes"]] == [list(s) for s in rotated], (rank, r)


def _averaging_worker(case):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    specs, loss_fn, vocab = _model(False)
    net = PipelineModule(layers=specs, num_stages=2, loss_fn=loss_fn, seed_layers=True, partition_method="uniform",
                         dynamic_shape=True)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    d = engine.grid.get_data_parallel_id()
    g = torch.Generator().manual_seed(3)
    lengths = {"within_each_replica": [5, 6, 5, 6], "within_one_replica": [[5, 6, 5, 6], [5] * GAS][d],
               "across_replicas": [5 + d] * GAS}[case]
    tokens = [torch.randint(0, vocab, (MICRO, n + 1), generator=g) for n in lengths]
    try:
        engine.eval_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]), compute_loss=False)
    except Exception as error:  # noqa: BLE001
        return {"type": type(error).__name__, "text": str(error)}
    return {"type": None}


@pytest.mark.parametrize("case", ["within_each_replica", "within_one_replica", "across_replicas"])
def test_an_average_of_outputs_whose_shapes_differ_is_refused_by_name(case):
    # 2 stages x 2 data: the last stage's two replicas both refuse (naming reduce_output=None as
    # the way), instead of torch's unnamed stack error, an all-reduce of unequal sizes, or one
    # replica waiting in the all-reduce for the other, which raised.
    results = run_distributed(_averaging_worker, 4, case, timeout=120, env={"ZEROSHARD_TIMEOUT": "5"})
    own = "output 0 of micro-batch 1 is torch.float32 [2, 6, 48], micro-batch 0's torch.float32 [2, 5, 48]"
    expected = {"within_each_replica": [own, own],
                "within_one_replica": [own, "data-parallel replica 0's outputs cannot be averaged"],
                "across_replicas": ["the data-parallel replicas' outputs differ in shape or dtype"] * 2}[case]
    for rank, text in zip((2, 3), expected):  # stage 1's ranks, data index 0 and 1
        r = results[rank]
        assert r["type"] == "ValueError", (rank, r)
        assert "eval_batch: reduce_output='avg'" in r["text"] and "reduce_output=None" in r["text"], (rank, r)
        assert text in r["text"], (rank, r)
