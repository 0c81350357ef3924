"""The runner every pipeline list goes through (pipe/list_run.py), for what the parity tests do
not see: the benchmark's timeline gets every instruction of the list but optimizer_step, in order;
on Gloo (matched by tag) each receive that follows a computation is started before it, the
gradients' and every activation's but a boundary's first; in NCCL's matching order none is. And a
send returns before its peer receives (with the first micro-batch's layout, and with dynamic_shape
every activation's, going with it)."""
import time

import pytest

from harness import run_distributed


def _worker(in_order):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import batches, layer_specs, loss_fn, rank_micro_batches
    net = PipelineModule(layers=layer_specs(2), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine._links.matches_in_order = in_order
    received, receive = [], engine._links.receive

    def recording(kind, stage, micro_batch, peer, like=None, posted=None):
        received.append((kind, micro_batch, posted is not None))
        return receive(kind, stage, micro_batch, peer, like, posted)

    engine._links.receive = recording
    engine._timeline = []
    engine.train_batch(rank_micro_batches(batches(1, 2, 4, 1), 2, 4, 0))
    timeline = [(op, mb, chunk) for op, mb, chunk, *_ in engine._timeline]
    listed = [(op, mb, chunk) for op, mb, chunk, _ in engine._instructions if op != "optimizer_step"]
    return {"timeline_is_the_list": timeline == listed, "received": received}


@pytest.mark.parametrize("in_order", [False, True], ids=["matched-by-tag", "matched-in-order-as-nccl"])
def test_the_timeline_and_the_receives_started_ahead(in_order):
    first, last = run_distributed(_worker, 2, in_order, timeout=120)
    assert first["timeline_is_the_list"] and last["timeline_is_the_list"]
    assert [kind for kind, _, _ in first["received"]] == ["gradient"] * 4
    assert [kind for kind, _, _ in last["received"]] == ["activation"] * 4
    ahead = {rank: [early for _, _, early in r["received"]] for rank, r in enumerate((first, last))}
    if in_order:
        assert ahead == {0: [False] * 4, 1: [False] * 4}, ahead
    else:
        # Stage 1's first receive opens its list (nothing to overlap) and learns the layout.
        assert ahead == {0: [True] * 4, 1: [False, True, True, True]}, ahead


def _late_receiver(dynamic_shape):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import batches, layer_specs, loss_fn, rank_micro_batches
    net = PipelineModule(layers=layer_specs(2), num_stages=2, loss_fn=loss_fn, seed_layers=True,
                         dynamic_shape=dynamic_shape)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "pipeline": {"schedule": "gpipe"}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine._timeline = []  # one clock for both processes (the trace's)
    if engine.is_last_stage():
        time.sleep(2)  # stage 0's first sends find no receive posted
    engine.train_batch(rank_micro_batches(batches(1, 2, 4, 1), 2, 4, 0))
    return {"sends_ended": [end for op, _, _, _, end in engine._timeline if op == "send_activation"],
            "receives_started": [start for op, _, _, start, _ in engine._timeline if op == "receive_activation"]}


@pytest.mark.parametrize("dynamic_shape", [False, True])
def test_a_send_returns_before_its_peer_receives(dynamic_shape):
    first, last = run_distributed(_late_receiver, 2, dynamic_shape, timeout=120)
    # Two messages may be in flight (p2p.SENDS_IN_FLIGHT); the third waits for the first. The
    # first two end before the sleeping peer starts its first receive.
    assert max(first["sends_ended"][:2]) < last["receives_started"][0], (first, last)
