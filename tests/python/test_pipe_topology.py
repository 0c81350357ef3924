"""zeroshard/pipe/topology.py against DeepSpeed's layout: the topologies' rank <-> coordinate math
and the grid's rank lists as pure functions for every (rank, world) up to 8 (global rank =
(stage * data + data index) * model + model index), then PipelineParallelGrid's accessors and
process groups in a 4-rank world (and a 1-rank one)."""
import pytest

from harness import run_distributed
from zeroshard.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                     ProcessTopology, default_topology, model_parallel_lists,
                                     p2p_pairs, prime_factors, slice_parallel_lists)

MAX_WORLD = 8
# Every (num_pp, num_dp, num_mp) with a product up to MAX_WORLD.
SHAPES = [(p, d, m) for p in range(1, MAX_WORLD + 1) for d in range(1, MAX_WORLD + 1)
          for m in range(1, MAX_WORLD + 1) if p * d * m <= MAX_WORLD]


def _rank(stage, data, model, shape):
    _, dp, mp = shape
    return (stage * dp + data) * mp + model


def _coord(rank, shape):
    _, dp, mp = shape
    return rank // (dp * mp), (rank // mp) % dp, rank % mp


def _topology(shape):
    pp, dp, mp = shape
    if mp == 1:
        return PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)


def _expected(rank, shape):
    """What DeepSpeed's grid holds for `rank` under `shape`, from the layout formula alone."""
    pp, dp, mp = shape
    s, d, m = _coord(rank, shape)
    pipeline = sorted(_rank(i, d, j, shape) for i in range(pp) for j in range(mp))
    return {
        "stage_id": s, "data_parallel_id": d, "slice_rank": m,
        "is_first_stage": s == 0, "is_last_stage": s == pp - 1,
        "dp_group": [_rank(s, i, m, shape) for i in range(dp)],
        "pp_group": [_rank(i, d, m, shape) for i in range(pp)],
        "slice_group": [_rank(s, d, j, shape) for j in range(mp)],
        "model_group": pipeline, "model_rank": pipeline.index(rank), "model_world_size": pp * mp,
        "p2p": [rank, _rank((s + 1) % pp, d, m, shape)],
        "stage_to_global": [_rank(t, d, m, shape) for t in range(pp)],
        "stage_to_global_data": [[_rank(t, e, m, shape) for e in range(dp)] for t in range(pp)],
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "pp%d-dp%d-mp%d" % s)
def test_topology_layout_for_every_rank(shape):
    pp, dp, mp = shape
    topo = _topology(shape)
    world = pp * dp * mp
    axes = ["pipe", "data"] + (["model"] if mp > 1 else [])
    assert topo.world_size() == world and topo.get_axis_names() == axes
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model")) == (pp, dp, mp if mp > 1 else 0)
    for rank in range(world):
        s, d, m = _coord(rank, shape)
        coord = topo.get_coord(rank)
        assert (coord.pipe, coord.data) == (s, d) and getattr(coord, "model", 0) == m
        assert topo.get_rank(**coord._asdict()) == rank
        assert topo.get_rank_repr(rank) == (f"model_{m:02d}" if mp > 1 else "")
        assert topo.get_rank_repr(rank, omit_axes=[]) == "-".join(
            [f"pipe_{s:02d}", f"data_{d:02d}"] + ([f"model_{m:02d}"] if mp > 1 else []))
    for s in range(pp):
        assert topo.get_axis_list("pipe", s) == topo.filter_match(pipe=s) == \
            [_rank(s, d, m, shape) for d in range(dp) for m in range(mp)]
    for d in range(dp):
        assert topo.get_axis_list("data", d) == [_rank(s, d, m, shape) for s in range(pp) for m in range(mp)]
    assert topo.get_axis_comm_lists("data") == [[_rank(s, i, m, shape) for i in range(dp)]
                                                for s in range(pp) for m in range(mp)]
    assert topo.get_axis_comm_lists("pipe") == [[_rank(i, d, m, shape) for i in range(pp)]
                                                for d in range(dp) for m in range(mp)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "pp%d-dp%d-mp%d" % s)
def test_grid_rank_lists_for_every_rank(shape):
    topo = _topology(shape)
    world = topo.world_size()
    models, slices, pairs = model_parallel_lists(topo), slice_parallel_lists(topo), p2p_pairs(topo)
    assert sorted(r for group in models for r in group) == list(range(world))
    assert sorted(r for group in slices for r in group) == list(range(world))
    for rank in range(world):
        want = _expected(rank, shape)
        assert [g for g in models if rank in g] == [want["model_group"]]
        assert [g for g in slices if rank in g] == [want["slice_group"]]
        assert pairs[rank] == want["p2p"]


def test_deepspeed_docstring_examples():
    xy = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert xy.get_rank(x=0, y=1) == 1
    assert (xy.get_coord(rank=1).x, xy.get_coord(rank=1).y) == (0, 1)
    assert xy.get_dim("y") == 3 and xy.get_dim("z") == 0
    assert xy.get_axis_list(axis="x", idx=0) == [0, 1, 2] and xy.get_axis_list(axis="y", idx=0) == [0, 3]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01" and ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    pdm = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert pdm.filter_match(pipe=0, data=1) == [2, 3]
    assert pdm.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pdm.get_axis_comm_lists("tensor") == []
    # Axis order decides adjacency: with ["y", "x"], x varies fastest.
    yx = ProcessTopology(axes=["y", "x"], dims=[3, 2])
    assert [yx.get_rank(x=0, y=0), yx.get_rank(x=1, y=0)] == [0, 1]


def test_topology_errors_name_the_problem():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match="expected exactly"):
        topo.get_rank(pipe=0)  # a slice: DeepSpeed points to filter_match
    with pytest.raises(ValueError, match="outside dims"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="repeat"):
        ProcessTopology(axes=["pipe", "pipe"], dims=[1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        PipeDataParallelTopology(num_pp=0, num_dp=2)


# DeepSpeed's grid without a topology: world's prime factors dealt to pipe, data, pipe, ...
DEFAULT_SHAPES = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2), 5: (5, 1), 6: (2, 3), 7: (7, 1), 8: (4, 2),
                  12: (6, 2), 30: (10, 3)}


@pytest.mark.parametrize("world", sorted(DEFAULT_SHAPES))
def test_default_topology_deals_prime_factors(world):
    topo = default_topology(world)
    assert (topo.get_dim("pipe"), topo.get_dim("data")) == DEFAULT_SHAPES[world]
    factors = prime_factors(world)
    assert factors == sorted(factors)
    product = 1
    for f in factors:
        product *= f
        assert all(f % k for k in range(2, f))
    assert product == world
    with pytest.raises(ValueError, match="positive"):
        prime_factors(0)


# ----- the grid in a real world -----

def _check_grid(shape):
    import torch
    import torch.distributed as dist

    from zeroshard.pipe import PipelineParallelGrid
    rank = dist.get_rank()
    if shape is None:  # no topology: DeepSpeed's default shape
        grid = PipelineParallelGrid()
        shape = DEFAULT_SHAPES[dist.get_world_size()] + (1,)
    else:
        grid = PipelineParallelGrid(topology=_topology(shape))
    want = _expected(rank, shape)
    pp, dp, mp = shape
    assert grid.topology().world_size() == grid.world_size == pp * dp * mp
    assert (grid.get_global_rank(), grid.global_rank) == (rank, rank)
    assert grid.stage_id == grid.get_stage_id() == grid.get_pipe_parallel_rank() == want["stage_id"]
    assert grid.data_parallel_id == grid.get_data_parallel_id() == grid.get_data_parallel_rank() == want["data_parallel_id"]
    assert (grid.is_first_stage, grid.is_last_stage) == (want["is_first_stage"], want["is_last_stage"])
    assert (grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size()) == (pp, dp)
    assert grid.get_model_parallel_world_size() == want["model_world_size"]  # DeepSpeed's: stages x slices
    assert grid.get_model_parallel_rank() == want["model_rank"]
    assert (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()) == (want["slice_rank"], mp)
    assert (grid.dp_group, grid.pp_group, grid.slice_group) == (want["dp_group"], want["pp_group"], want["slice_group"])
    assert grid.p2p_groups[rank] == want["p2p"] and len(grid.p2p_groups) == grid.world_size
    assert [grid.stage_to_global(t) for t in range(pp)] == want["stage_to_global"]
    assert [[grid.stage_to_global(t, data=e) for e in range(dp)] for t in range(pp)] == want["stage_to_global_data"]
    assert grid._is_grid_valid()
    # The get_*_group() methods give the process groups, and each holds exactly its rank list.
    for group, ranks in ((grid.get_data_parallel_group(), want["dp_group"]),
                         (grid.get_pipe_parallel_group(), want["pp_group"]),
                         (grid.get_model_parallel_group(), want["model_group"]),
                         (grid.get_slice_parallel_group(), want["slice_group"])):
        assert dist.get_world_size(group) == len(ranks)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        assert total.item() == sum(ranks), (ranks, total.item())
    assert grid.get_data_parallel_group() is grid.dp_proc_group
    assert grid.get_pipe_parallel_group() is grid.pp_proc_group


def _grid_worker(cases):
    """Every case in one world (a launch costs seconds, a grid milliseconds); returns the cases
    that passed, and raises naming the first that did not."""
    from zeroshard.comm import init_distributed
    init_distributed()
    for name, shape in cases.items():
        try:
            _check_grid(shape)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from e
    return list(cases)


# name -> (num_pp, num_dp, num_mp) at world 4, or None for no topology (DeepSpeed's default shape)
GRID_CASES = {"default": None, "pp2-dp2": (2, 2, 1), "pp4": (4, 1, 1), "dp4": (1, 4, 1),
              "pp2-mp2": (2, 1, 2), "dp2-mp2": (1, 2, 2)}


def test_grid_accessors_and_groups_at_world_4():
    assert run_distributed(_grid_worker, 4, GRID_CASES) == [list(GRID_CASES)] * 4


def test_grid_at_world_1():
    assert run_distributed(_grid_worker, 1, {"default": None}) == [["default"]]


def _call_sites_worker():
    import torch.distributed as dist

    from zeroshard.comm import init_distributed
    from zeroshard.pipe import PipelineParallelGrid
    init_distributed()
    rank = dist.get_rank()
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    # DeepSpeed's keywords; the world, and a group of every rank as DeepSpeed's PipelineModule
    # passes it.
    everyone = dist.new_group(list(range(4)))
    for grid in (PipelineParallelGrid(topo), PipelineParallelGrid(topology=topo, process_group=None),
                 PipelineParallelGrid(topo, dist.group.WORLD),
                 PipelineParallelGrid(process_group=everyone, topology=topo)):
        assert (grid.stage_id, grid.data_parallel_id) == (rank // 2, rank % 2)
    errors = []
    half = dist.new_group([0, 1])  # every rank creates it, as new_group requires
    for call in (lambda: PipelineParallelGrid(topo, (rank + 1) % 4),
                 lambda: PipelineParallelGrid(topo, half),
                 lambda: PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1)),
                 lambda: PipelineParallelGrid(ProcessTopology(axes=["x", "y"], dims=[2, 2]))):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_grid_call_sites_and_errors():
    for rank, errors in enumerate(run_distributed(_call_sites_worker, 4)):
        wrong_rank, subgroup, small, axes = errors
        assert wrong_rank == f"PipelineParallelGrid: process_group must be a torch.distributed group, got int {(rank + 1) % 4}"
        assert subgroup.startswith("PipelineParallelGrid: process_group " +
                                   ("holds 2 of the world's 4 ranks" if rank < 2 else "does not hold this rank"))
        assert "holds 2 ranks, the world has 4" in small
        assert "a grid needs 'pipe' and 'data'" in axes
