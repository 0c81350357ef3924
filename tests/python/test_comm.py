"""The C++ comm wrapper (runtime/comm.cpp, bound as _C.Comm) on in-process Gloo groups: one thread
per rank, each with its own connection to one TCPStore, so every collective runs for real inside the pytest process.
(Torch's wheel ships no Gloo headers, so the group is built here rather than in a Catch2 test.)"""
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.comm import _TORCH_FLIGHT_RECORDER_KEYS


def _gloo_group(store, rank, world):
    pg = dist.ProcessGroup(store, rank, world)
    backend = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def on_ranks(world, body, with_store=False, debug=None, timeout_s=30.0):
    """body(comm) on every rank; with_store passes the groups' store to Comm (errors then name
    every rank), debug the agreement check (None: the environment's setting)."""
    # As in a real job, every rank has its own connection to one TCPStore (the server lives in the
    # test process); a single HashStore shared by all rank threads is not what ranks ever see.
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    stores = [dist.TCPStore("127.0.0.1", server.port, world, is_master=False) for _ in range(world)]
    errors = [None] * world
    results = [None] * world
    # Every rank's group stays alive until all threads are done: a group torn down while a peer
    # is still finishing the last collective would strand that peer.
    comms = [None] * world

    def build(rank):
        try:
            comms[rank] = _C.Comm(_gloo_group(stores[rank], rank, world), timeout_s,
                                  store=stores[rank] if with_store else None, debug_collectives=debug)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors[rank] = e

    def run(rank):
        try:
            results[rank] = body(comms[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors[rank] = e

    # Two phases: every group is fully built (the groups rendezvous, so concurrently) before any
    # rank issues a collective; building one while another rank already communicates crashed
    # intermittently inside torch's Gloo set-up.
    for phase in (build, run):
        threads = [threading.Thread(target=phase, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a rank thread hung"
        if any(e is not None for e in errors):
            break
    comms.clear()
    for e in errors:
        if e is not None:
            raise e
    return results


# In debug mode every rank leaves the same store wait at once, so all groups issue their first
# collective together: the case that caught torch's unlocked flight-recorder insert (see
# host_issue_mutex in runtime/comm.cpp).
@pytest.mark.parametrize("world,with_store,debug", [(1, False, None), (2, False, None), (4, False, None),
                                                    (2, True, False), (4, True, True)])
def test_collectives(world, with_store, debug):
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
        assert c.all_reduce_values([r + 1.0, 0.5], "cpu", "values") == [world * (world + 1) / 2, 0.5 * world]
        buf = torch.arange(4 * world, dtype=torch.float32) + r
        c.reduce_scatter_in_place(buf, "reduce_scatter_in_place")
        assert torch.equal(buf[4 * r:4 * r + 4], out)  # this rank's part: the reduce-scatter's result
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
    sequences = on_ranks(world, body, with_store, debug)
    assert len(set(sequences)) == 1 and sequences[0] == 9  # one number per collective, same on all


def test_shape_errors_name_the_collective_and_sizes():
    def body(c):
        with pytest.raises(RuntimeError, match="reduce_scatter\\(grads\\): input has 5 elements, "
                                               "expected world_size 2 x 2"):
            c.reduce_scatter(torch.zeros(2), torch.zeros(5), "grads")
        with pytest.raises(RuntimeError, match="reduce_scatter_in_place\\(grads\\): 5 elements do not "
                                               "split into world_size 2 parts"):
            c.reduce_scatter_in_place(torch.zeros(5), "grads")
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
    with pytest.raises(_C.CommError, match=r"collective timeout after 2 s on rank 0 in #1 "
                                           r"all_reduce\(lonely, 4 x Float, 16 B\): rank 0 is in #1 "
                                           r"all_reduce\(lonely, 4 x Float, 16 B\) \(the other ranks are "
                                           r"unknown: this communicator has no store\)"):
        comm.all_reduce(torch.ones(4), "lonely")
    pgs[1].allreduce([torch.ones(4)]).wait()


def test_descriptions_carry_bytes_and_the_flight_recorder_keeps_the_latest():
    def body(c):
        c.all_reduce(torch.ones(8), "sum")
        c.broadcast(torch.ones(3, dtype=torch.bfloat16), 1, "params")
        for i in range(10):
            c.all_reduce_max(torch.ones(1), f"flag {i}")
        return c.recent_collectives()
    for recent in on_ranks(2, body, with_store=True):
        assert recent.startswith("#5 all_reduce_max(flag 2, 1 x Float, 4 B) done, ")  # a ring of 8
        assert recent.endswith("#12 all_reduce_max(flag 9, 1 x Float, 4 B) done")
    recent = on_ranks(2, lambda c: (c.broadcast(torch.ones(3, dtype=torch.bfloat16), 1, "params"),
                                    c.recent_collectives())[1])
    assert recent[0] == "#1 broadcast(params, root 1, 3 x BFloat16, 6 B) done"


def test_the_backend_never_holds_the_callers_tensor():
    # Gloo's worker thread keeps a collective's tensors until it drops the work, which can be after
    # wait() returned. Were they the caller's own, the worker could drop the last reference to a
    # tensor with a Python object, which takes the GIL: at interpreter exit that aborts the process.
    # The bindings hand the backend a tensor of their own over the same storage, so the caller's
    # tensor is referenced by its Python object alone as soon as a call returns.
    def body(c):
        held = 0
        for i in range(500):
            t = torch.ones(64)
            c.broadcast(t, 0, "params")
            c.all_reduce(t, "sum")
            c.all_reduce_max(t, "max")
            held += t._use_count() > 1
            assert torch.equal(t, torch.full((64,), 2.0))  # the results still land in t
        return held
    assert on_ranks(2, body) == [0, 0]


@pytest.mark.parametrize("case", ["what", "numel", "dtype", "op"])
def test_debug_mode_raises_the_same_mismatch_on_every_rank(case):
    """The agreement check runs before the collective reaches Gloo, so nothing is left in flight."""
    def body(c):
        r = c.rank
        c.all_reduce(torch.ones(4), "agreed")
        if case == "what":
            c.all_reduce(torch.ones(4), f"bucket {r}")
        elif case == "numel":
            c.all_reduce(torch.ones(4 + r), "bucket")
        elif case == "dtype":
            c.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64), "bucket")
        else:
            (c.all_reduce if r == 0 else c.all_reduce_max)(torch.ones(4), "bucket")

    def run(c):
        assert c.checks_agreement
        with pytest.raises(_C.CommError) as err:
            body(c)
        return str(err.value)
    messages = on_ranks(2, run, with_store=True, debug=True)
    expected = {
        "what": "rank 0 all_reduce(bucket 0, 4 x Float, 16 B), rank 1 all_reduce(bucket 1, 4 x Float, 16 B)",
        "numel": "rank 0 all_reduce(bucket, 4 x Float, 16 B), rank 1 all_reduce(bucket, 5 x Float, 20 B)",
        "dtype": "rank 0 all_reduce(bucket, 4 x Float, 16 B), rank 1 all_reduce(bucket, 4 x Double, 32 B)",
        "op": "rank 0 all_reduce(bucket, 4 x Float, 16 B), rank 1 all_reduce_max(bucket, 4 x Float, 16 B)",
    }[case]
    for rank, m in enumerate(messages):
        assert m.startswith(f"collective mismatch at #2: {expected} (seen by rank {rank}; "), m


def test_debug_mode_needs_a_store():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="ZEROSHARD_DEBUG_COLLECTIVES=1: .* pass store="):
        _C.Comm(_gloo_group(store, 0, 1), 1.0, debug_collectives=True)


def _groups(world):
    store = dist.HashStore()
    pgs = [None] * world

    def make(rank):
        pgs[rank] = _gloo_group(store, rank, world)
    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return store, pgs


def test_a_missing_peer_is_named_by_its_last_collective():
    """Rank 1 does one all_reduce, then never joins the second: rank 0's timeout error names rank
    1's last published collective (the store keeps it, as it would for a dead rank)."""
    store, pgs = _groups(2)
    comms = [_C.Comm(pgs[r], 1.0, store=store) for r in range(2)]
    threads = [threading.Thread(target=comms[r].all_reduce, args=(torch.ones(4), "first")) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = time.monotonic()
    with pytest.raises(_C.CommError) as err:
        comms[0].all_reduce(torch.ones(2), "second")
    elapsed = time.monotonic() - start
    assert str(err.value).startswith(
        "collective timeout after 1 s on rank 0 in #2 all_reduce(second, 2 x Float, 8 B): "
        "rank 0 is in #2 all_reduce(second, 2 x Float, 8 B); "
        "rank 1 last started #1 all_reduce(first, 4 x Float, 16 B) (no report: dead?). "
        "Recent on rank 0: #1 all_reduce(first, 4 x Float, 16 B) done, "
        "#2 all_reduce(second, 2 x Float, 8 B) failed."), str(err.value)
    assert elapsed < 1.0 + 3.0 + 2.0  # timeout + the wait for reports + slack
    pgs[1].allreduce([torch.ones(2)]).wait()  # let the collective left in flight finish


def test_a_rank_reporting_twice_counts_once_among_the_readers():
    """A rank whose failure is reported twice counts once among the reports' readers (see
    CommMonitor::failure_message): rank 0 reports once, rank 1 twice, and the count is 2."""
    store, pgs = _groups(2)
    comms = [_C.Comm(pgs[r], 1.0, store=store) for r in range(2)]

    def fail(rank, what):
        with pytest.raises(_C.CommError, match=f"collective failed on rank {rank}"):
            comms[rank].fail_here(what, "")
    # Together, so that each finds the other's report at once instead of waiting for it.
    threads = [threading.Thread(target=fail, args=(r, "recv(activation)")) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fail(1, "pipeline stage 1 forward of micro-batch 0")
    comm_id = store.add("zeroshard/comms/1", 0)  # the key prefix CommMonitor gave this communicator
    assert store.add(f"zeroshard/{comm_id}/read", 0) == 2


def test_one_ranks_failure_ends_the_other_ranks_wait():
    """Ranks 0 (timeout 1 s) and 1 (timeout 60 s) enter an all_reduce that rank 2 joins only later.
    Rank 0 times out and says so in the store; rank 1 sees it within a poll interval instead of
    waiting 60 s, and both errors name every rank's state."""
    store, pgs = _groups(3)
    comms = [_C.Comm(pgs[0], 1.0, store=store), _C.Comm(pgs[1], 60.0, store=store)]
    errors, elapsed = [None, None], [None, None]

    def run(rank):
        start = time.monotonic()
        try:
            comms[rank].all_reduce(torch.ones(3), "stuck")
        except _C.CommError as e:
            errors[rank] = str(e)
        elapsed[rank] = time.monotonic() - start
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a rank thread hung"
    states = ("ranks 0-1 are in #1 all_reduce(stuck, 3 x Float, 12 B); rank 2: no report (dead?)")
    assert errors[0].startswith("collective timeout after 1 s on rank 0 in #1 all_reduce(stuck, "
                                f"3 x Float, 12 B): {states}"), errors[0]
    assert errors[1].startswith("collective aborted on rank 1 in #1 all_reduce(stuck, 3 x Float, "
                                f"12 B) because rank 0 failed: {states}"), errors[1]
    assert elapsed[1] < 10.0, elapsed
    pgs[2].allreduce([torch.ones(3)]).wait()  # complete the collective left in flight


# torch's own c10d flight recorder is off on a Gloo run that zeroshard starts (zeroshard/comm.py),
# unless the user sized it under either of torch's names. One process per case: torch reads the
# size once per process.
_FLIGHT_RECORDER_SCRIPT = textwrap.dedent("""
    import os, pickle, socket
    import torch, torch.distributed as dist
    import zeroshard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    zeroshard.init_distributed(dist_backend="gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]
    print(len(entries), os.environ.get("TORCH_FR_BUFFER_SIZE"), flush=True)
""")


@pytest.mark.parametrize("user_env, want", [
    ({}, "0 0"),                                          # unset: off
    ({"TORCH_FR_BUFFER_SIZE": "100"}, "2 100"),           # sized by the user: kept
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, "2 None"),  # torch's older name: kept too
])
def test_torch_flight_recorder_is_off_unless_the_user_sized_it(user_env, want):
    env = {k: v for k, v in os.environ.items()
           if k not in _TORCH_FLIGHT_RECORDER_KEYS + ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", _FLIGHT_RECORDER_SCRIPT], env={**env, **user_env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == want, r.stdout + r.stderr
