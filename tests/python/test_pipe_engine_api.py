"""The pipeline engine's API as DeepSpeed, Megatron-DeepSpeed and GPT-NeoX scripts call it, at
2 stages: deepspeed.PipelineEngine for isinstance, set_batch_fn (Megatron's batch function),
set_dataloader, set_has_attention_mask with a boolean mask crossing the stages in a tuple beside
the hidden states, reset_activation_shape before a longer sequence, pipeline.activation_checkpoint_
interval from the config (the blocks really recompute), eval_batch's reduce_output and compute_
loss forms, train_batch's loss on the device, and a partition by type that differs from the
partition by parameters; and, at 2 data-parallel replicas, eval_batch(compute_loss=False)
averaging floating outputs and naming an integer one (a mask) instead of averaging it; eval_batch's
order through two model chunks per rank (groups of micro-batches) and its refusal of 0 micro-batches.
(PipelineModule(dynamic_shape=True): test_pipe_dynamic_shape.py.)"""
import torch

from harness import run_distributed
from pipe_models import MASKED_VOCAB as VOCAB, MaskedBlock, MaskedEmbed, MaskedLMHead, masked_loss

MICRO, GAS = 2, 2


def _sequences(count, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (MICRO, seq + 1), generator=g) for _ in range(count)]


def _api_worker():
    import zeroshard as deepspeed  # as DeepSpeed scripts import it
    from zeroshard.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(MaskedEmbed)] + [LayerSpec(MaskedBlock) for _ in range(4)] + [LayerSpec(MaskedLMHead)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=masked_loss,
                         partition_method="type:MaskedEmbed|MaskedLMHead")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000,
              "pipeline": {"activation_checkpoint_interval": 1, "use_reentrant": False}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    out = {"is_engine": isinstance(engine, deepspeed.PipelineEngine), "parts": list(net.parts),
           "interval": net.activation_checkpoint_interval}
    engine.set_has_attention_mask(True)
    # Megatron-style: the loader yields raw sequences, the batch function splits them.
    engine.set_batch_fn(lambda seq: (seq[:, :-1], seq[:, 1:]))
    engine.set_dataloader(_sequences(4, 6, seed=1))
    MaskedBlock.forwards = 0
    loss = engine.train_batch()
    out["loss_device"] = str(loss.device)
    out["loss_is_tensor"] = torch.is_tensor(loss)
    out["block_forwards"] = MaskedBlock.forwards  # 2 blocks on this stage x 2 micro-batches, x2 with recompute
    # A longer sequence from the next batch on: every rank agrees on the new layout.
    engine.reset_activation_shape()
    engine.set_batch_fn(None)
    longer = iter([(s[:, :-1], s[:, 1:]) for s in _sequences(GAS, 9, seed=2)])
    out["longer_loss"] = float(engine.train_batch(longer))
    evaluation = [(s[:, :-1], s[:, 1:]) for s in _sequences(GAS, 9, seed=3)]
    out["eval_avg"] = float(engine.eval_batch(iter(evaluation), reduce_output="AVG"))
    per_micro = engine.eval_batch(iter(evaluation), reduce_output=None)
    out["eval_list"] = None if per_micro is None else [float(x) for x in per_micro]
    logits = engine.eval_batch(iter(evaluation), compute_loss=False)
    out["logits_shape"] = None if logits is None else list(logits.shape)
    try:
        engine.eval_batch(None)
        out["none_error"] = None
    except ValueError as error:
        out["none_error"] = str(error)
    return out


def test_the_pipeline_engine_as_deepspeed_scripts_use_it():
    results = run_distributed(_api_worker, 2, timeout=180)
    for rank, r in enumerate(results):
        assert r["is_engine"], f"rank {rank}: isinstance(engine, deepspeed.PipelineEngine) is False"
        # type:MaskedEmbed|MaskedLMHead weighs only those two: one per stage, the blocks spread evenly.
        assert r["parts"] == [0, 3, 6], f"rank {rank}: partition {r['parts']}"
        assert r["interval"] == 1, f"rank {rank}: the config's activation_checkpoint_interval did not apply"
        assert r["loss_is_tensor"] and r["loss_device"] == "cpu", r
        # Each stage holds 2 blocks; each of the 2 micro-batches runs them in forward and again in
        # backward (recomputed): 8 calls, 4 without checkpointing.
        assert r["block_forwards"] == 8, f"rank {rank}: {r['block_forwards']} block forwards"
        assert r["longer_loss"] > 0
        assert abs(r["eval_avg"] - sum(results[1]["eval_list"]) / GAS) < 1e-6, r
        assert r["none_error"] is not None and "data_iter is None" in r["none_error"], r
    assert results[1]["eval_list"] is not None and len(results[1]["eval_list"]) == GAS
    assert results[0]["eval_list"] is None and results[0]["logits_shape"] is None
    # compute_loss=False, reduce_output "avg": the last stage's logits averaged over micro-batches.
    assert results[1]["logits_shape"] == [MICRO, 9, VOCAB]


class MaskedHead(MaskedLMHead):
    """Head that also returns the padding mask when with_mask is set (read at each forward)."""
    with_mask = True

    def forward(self, inputs):
        return (self.out(inputs[0]), inputs[1]) if MaskedHead.with_mask else self.out(inputs[0])


def _eval_outputs_worker():
    """1 stage x 2 data: eval_batch(compute_loss=False) averages floating outputs over
    micro-batches and replicas, and names an integer one instead of averaging it."""
    import torch.distributed as dist
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule

    net = PipelineModule(layers=[LayerSpec(MaskedEmbed), LayerSpec(MaskedBlock), LayerSpec(MaskedHead)],
                         num_stages=1, loss_fn=masked_loss)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    data = [(s[:, :-1], s[:, 1:]) for s in _sequences(GAS, 6, seed=10 + dist.get_rank())]
    out = {"dp": engine.dp_world_size}
    MaskedHead.with_mask = True
    try:
        engine.eval_batch(iter(data), compute_loss=False)
        out["mask_error"] = None
    except ValueError as error:
        out["mask_error"] = str(error)
    as_is = engine.eval_batch(iter(data), compute_loss=False, reduce_output=None)
    out["as_is_dtypes"] = [[str(t.dtype) for t in mb] for mb in as_is]
    MaskedHead.with_mask = False
    own = engine.eval_batch(iter(data), compute_loss=False, reduce_output=None)
    own_mean = torch.stack(own).mean(0)
    both = [torch.zeros_like(own_mean) for _ in range(2)]
    dist.all_gather(both, own_mean)
    averaged = engine.eval_batch(iter(data), compute_loss=False)
    out["avg_err"] = float((averaged - (both[0] + both[1]) / 2).abs().max())
    return out


def test_eval_outputs_average_floats_and_name_an_integer_output():
    results = run_distributed(_eval_outputs_worker, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["dp"] == 2, r
        assert r["mask_error"] is not None and "output 1 of micro-batch 0 is torch.bool" in r["mask_error"], r
        assert "reduce_output=None" in r["mask_error"], r
        # reduce_output=None: every micro-batch's outputs as they are, the mask a mask.
        assert r["as_is_dtypes"] == [["torch.float32", "torch.bool"]] * GAS, r
        # Floating outputs: the mean over micro-batches and both replicas.
        assert r["avg_err"] < 1e-6, f"rank {rank}: {r['avg_err']}"


def _tuple_boundary_worker(in_order):
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule
    torch.manual_seed(0)
    layers = [LayerSpec(MaskedEmbed)] + [LayerSpec(MaskedBlock) for _ in range(4)] + [LayerSpec(MaskedLMHead)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=masked_loss, partition_method="uniform", seed_layers=True,
                         virtual_stages=2)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000,
              "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine._links.matches_in_order = in_order  # NCCL's matching order, over Gloo
    data = [(s[:, :-1], s[:, 1:]) for s in _sequences(3 * GAS, 6, seed=4)]
    losses = [float(engine.train_batch(iter(data[i * GAS:(i + 1) * GAS]))) for i in range(3)]
    evaluated = float(engine.eval_batch(iter(data[:GAS])))
    return losses + [evaluated]


def test_a_tuple_with_a_mask_crosses_stages_in_nccls_matching_order_as_by_tag():
    # (hidden, bool mask) at every boundary, interleaved (both directions between the two ranks
    # carry activations and gradients), training and eval_batch.
    by_tag = run_distributed(_tuple_boundary_worker, 2, False, timeout=120)
    in_order = run_distributed(_tuple_boundary_worker, 2, True, timeout=120)
    assert by_tag == in_order, (by_tag, in_order)


def _eval_order_worker():
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule
    torch.manual_seed(0)
    layers = [LayerSpec(MaskedEmbed)] + [LayerSpec(MaskedBlock) for _ in range(2)] + [LayerSpec(MaskedLMHead)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=masked_loss, partition_method="uniform", virtual_stages=2)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000,
              "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    chunks, forward = [], net.forward

    def recording(x, chunk=0):
        chunks.append(chunk)
        return forward(x, chunk=chunk)

    net.forward = recording
    data = [(s[:, :-1], s[:, 1:]) for s in _sequences(3, 6, seed=5)]
    engine.eval_batch(iter(data), num_micro_batches=3)
    out = {"chunks": chunks}
    try:
        engine.eval_batch(iter(data), num_micro_batches=0)
        out["zero"] = None
    except ValueError as error:
        out["zero"] = str(error)
    return out


def test_eval_batch_runs_micro_batches_in_groups_through_the_chunks():
    # 2 stages x 2 chunks, 3 micro-batches: each rank forwards micro-batches 0 and 1 through its
    # chunk 0 while micro-batch 0 goes round to the other rank, then through chunk 1, then the
    # short last group (micro-batch 2). One micro-batch through every chunk before the next
    # (0, 1, 0, 1, ...) would leave a rank idle while its micro-batch is on the other.
    for r in run_distributed(_eval_order_worker, 2, timeout=120):
        assert r["chunks"] == [0, 0, 1, 1, 0, 1], r
        assert r["zero"] == "eval_batch: num_micro_batches: got 0, expected >= 1", r
