"""The C++ comm wrapper (runtime/comm.cpp, bound as _C.Comm) on in-process Gloo groups: one thread
per rank, sharing a HashStore, so every collective runs for real inside the pytest process.
(Torch's wheel ships no Gloo headers, so the group is built here rather than in a Catch2 test.)"""
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from zeroshard import _C


def _gloo_group(store, rank, world):
    pg = dist.ProcessGroup(store, rank, world)
    backend = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def on_ranks(world, body):
    store = dist.HashStore()
    errors = [None] * world
    results = [None] * world
    # Every rank's group stays alive until all threads are done: a group torn down while a peer
    # is still finishing the last collective would strand that peer.
    comms = [None] * world

    def run(rank):
        try:
            comms[rank] = _C.Comm(_gloo_group(store, rank, world), 30.0)
            results[rank] = body(comms[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank thread hung"
    comms.clear()
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives(world):
    def body(c):
        r = c.rank
        assert c.world_size == world and c.backend == "gloo"
        x = torch.full((8,), float(r + 1))
        c.all_reduce(x, "sum")
        assert torch.equal(x, torch.full((8,), world * (world + 1) / 2))
        inp = torch.arange(4 * world, dtype=torch.float32) + r
        out = torch.empty(4)
        c.reduce_scatter(out, inp, "reduce_scatter")
        assert torch.equal(out, torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) * world
                           + world * (world - 1) / 2)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            flat = torch.zeros(3 * world, dtype=dtype)
            flat[3 * r:3 * r + 3] = r + 1
            c.all_gather(flat, flat[3 * r:3 * r + 3], "in-place all_gather")
            assert torch.equal(flat, torch.arange(1, world + 1).repeat_interleave(3).to(dtype))
        b = torch.full((5,), float(r))
        c.broadcast(b, world - 1, "broadcast")
        assert torch.equal(b, torch.full((5,), float(world - 1)))
        c.barrier("end")
        return c.sequence
    sequences = on_ranks(world, body)
    assert len(set(sequences)) == 1 and sequences[0] == 7  # one number per collective, same on all


def test_shape_errors_name_the_collective_and_sizes():
    def body(c):
        with pytest.raises(RuntimeError, match="reduce_scatter\\(grads\\): input has 5 elements, "
                                               "expected world_size 2 x 2"):
            c.reduce_scatter(torch.zeros(2), torch.zeros(5), "grads")
        with pytest.raises(RuntimeError, match="all_gather\\(params\\): output has 5 elements, "
                                               "expected world_size 2 x 2"):
            c.all_gather(torch.zeros(5), torch.zeros(2), "params")
    on_ranks(2, body)


def test_a_late_peer_ends_in_an_error_naming_rank_sequence_and_collective():
    """Rank 1 has not joined the all_reduce when rank 0's timeout passes: rank 0 gets a CommError
    naming itself, the sequence number and the collective, not a hang. Rank 1 joins afterwards so
    the collective left in flight completes and both groups shut down."""
    store = dist.HashStore()
    pgs = [None, None]

    def make(rank):
        pgs[rank] = _gloo_group(store, rank, 2)
    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    comm = _C.Comm(pgs[0], 2.0)
    with pytest.raises(_C.CommError, match=r"rank 0: collective #1 all_reduce\(lonely, 4 x Float\) "
                                           r"failed: .*timed out"):
        comm.all_reduce(torch.ones(4), "lonely")
    pgs[1].allreduce([torch.ones(4)]).wait()
