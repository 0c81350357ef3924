"""The runner every pipeline list goes through (pipe/list_run.py), for what the parity tests do
not see: the benchmark's timeline gets every instruction of the list but optimizer_step, in order,
and before each computation that uses received data, the wait for it; on Gloo (matched by tag) each
receive that follows a computation is started before it, the gradients' and every activation's but
a boundary's first; in NCCL's matching order none is. A rank waits for received data where it uses
it, not at the receive, so it sends what it owes first. And a send returns before its peer
receives (with the first micro-batch's layout, and with dynamic_shape every activation's, going
with it)."""
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
    started, starting = [], []  # (kind, micro-batch, when); the start_receive calls under way
    post, start_receive = engine._links.post, engine._links.start_receive

    def recording_post(kind, stage, micro_batch, peer, like=None, layout=None):
        posted = post(kind, stage, micro_batch, peer, like, layout)
        if posted is not None and not starting:
            started.append((kind, micro_batch, "ahead"))
        return posted

    def recording_start(kind, stage, micro_batch, peer, like=None):
        starting.append(True)
        try:
            return start_receive(kind, stage, micro_batch, peer, like)
        finally:
            starting.pop()
            started.append((kind, micro_batch, "at its instruction"))

    engine._links.post, engine._links.start_receive = recording_post, recording_start
    engine._timeline = []
    engine.train_batch(rank_micro_batches(batches(1, 2, 4, 1), 2, 4, 0))
    timeline = [(op, mb, chunk) for op, mb, chunk, *_ in engine._timeline]
    listed = [(op, mb, chunk) for op, mb, chunk, _ in engine._instructions if op != "optimizer_step"]
    from zeroshard.pipe.list_run import WAIT_NAMES
    uses = {WAIT_NAMES["receive_activation"]: "forward", WAIT_NAMES["receive_gradient"]: "backward"}
    waits_precede_their_use = all(i + 1 < len(timeline) and timeline[i + 1] == (uses[op], mb, chunk)
                                  for i, (op, mb, chunk) in enumerate(timeline) if op in uses)
    return {"instructions": [t for t in timeline if t[0] not in uses] == listed,
            "waits": [t for t in timeline if t[0] in uses],
            "waits_precede_their_use": waits_precede_their_use, "started": started}


@pytest.mark.parametrize("in_order", [False, True], ids=["matched-by-tag", "matched-in-order-as-nccl"])
def test_the_timeline_and_the_receives_started_ahead(in_order):
    first, last = run_distributed(_worker, 2, in_order, timeout=120)
    assert first["instructions"] and last["instructions"]
    assert first["waits_precede_their_use"] and last["waits_precede_their_use"]
    assert first["waits"] == [("wait_gradient", mb, 0) for mb in range(4)]
    assert last["waits"] == [("wait_activation", mb, 0) for mb in range(4)]
    assert [kind for kind, _, _ in first["started"]] == ["gradient"] * 4
    assert [kind for kind, _, _ in last["started"]] == ["activation"] * 4
    when = {rank: [w for _, _, w in r["started"]] for rank, r in enumerate((first, last))}
    if in_order:
        assert when == {0: ["at its instruction"] * 4, 1: ["at its instruction"] * 4}, when
    else:
        # Stage 1's first receive opens its list (nothing to overlap) and learns the layout.
        assert when == {0: ["ahead"] * 4, 1: ["at its instruction"] + ["ahead"] * 3}, when


def _slow_first_stage(in_order):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import batches, layer_specs, loss_fn, rank_micro_batches
    net = PipelineModule(layers=layer_specs(2), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    engine._links.matches_in_order = in_order
    if engine.is_first_stage():
        forward = net.forward

        def slow_forward(*args, **kwargs):
            time.sleep(0.5)
            return forward(*args, **kwargs)

        net.forward = slow_forward
    engine._timeline = []  # one clock for both processes (the trace's)
    engine.train_batch(rank_micro_batches(batches(1, 2, 4, 1), 2, 4, 0))
    return {(op, mb): (start, end) for op, mb, _, start, end in engine._timeline}


@pytest.mark.parametrize("in_order", [False, True], ids=["matched-by-tag", "matched-in-order-as-nccl"])
def test_a_rank_sends_what_it_owes_before_it_waits_for_data(in_order):
    """Stage 1's 1F1B list reads "backward 0, receive activation 1, send gradient 0, forward 1":
    the gradient goes out at once, while stage 0 is still in its (slow) forward of micro-batch 1,
    and stage 1 waits for that activation only at its forward (on NCCL itself, not here: see
    ListRun.run)."""
    first, last = run_distributed(_slow_first_stage, 2, in_order, timeout=120)
    assert last[("send_gradient", 0)][1] < first[("send_activation", 1)][0], (first, last)
    assert last[("wait_activation", 1)][1] > first[("send_activation", 1)][0], (first, last)
    assert last[("send_gradient", 0)][1] <= last[("wait_activation", 1)][0] <= last[("forward", 1)][0]


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


def test_a_receive_never_used_is_an_error_published_for_the_other_ranks():
    """A list not built by pipeline/schedule.cpp may start a receive no computation uses; its
    message would meet a later step's. One process, the engine's parts stood in for."""
    import contextlib
    import types
    from zeroshard.pipe.list_run import ListRun
    ns = types.SimpleNamespace
    published = []

    @contextlib.contextmanager
    def reported(what):
        try:
            yield
        except RuntimeError:
            published.append(what)
            raise

    links = ns(posts_ahead=False, finish=lambda: None, start_receive=lambda *a, **k: ns(wait=lambda: ()))
    engine = ns(module=ns(num_global_stages=2, global_stage=lambda chunk: 1, stage_id=1), _links=links,
                _needs_data=lambda: False, _grid=ns(stage_to_global=lambda stage: stage), _timeline=None,
                _observer=ns(wants_instructions=False), _named_by_world=lambda what: contextlib.nullcontext(),
                _stage_failure_reported=reported)

    class Run(ListRun):
        OPS = ("receive_activation",)

    with pytest.raises(RuntimeError, match=r"never used: \[\('receive_activation', 0, 0\)\]"):
        Run(engine, None).run([("receive_activation", 0, 0, 0)])
    assert published == ["pipeline stage 1 end of its list"]
