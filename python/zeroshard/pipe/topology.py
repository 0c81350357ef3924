"""DeepSpeed's process topology (deepspeed.runtime.pipe.topology): ranks laid out on named axes,
the last axis varying fastest. PipeDataParallelTopology(num_pp, num_dp) puts global rank
stage * num_dp + data_index at coordinate (pipe=stage, data=data_index), so a stage's data
replicas are neighbours. PipelineParallelGrid turns a topology into this rank's groups."""
from collections import namedtuple
from itertools import product


class ProcessTopology:
    def __init__(self, axes, dims):
        if len(axes) != len(dims) or not axes:
            raise ValueError(f"ProcessTopology: got axes {axes} and dims {dims}; expected one "
                             "dimension per axis and at least one axis")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axes {axes} repeat a name")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: dims {dims} must all be >= 1")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        for rank, coord in enumerate(product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def world_size(self):
        return len(self.mapping)

    def get_axis_names(self):
        return list(self.axes)

    def get_dim(self, axis):
        if axis not in self.axes:
            return 0  # DeepSpeed's answer for an axis the topology does not have
        return self.dims[self.axes.index(axis)]

    def get_rank(self, **coord_kwargs):
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank: got coordinates {sorted(coord_kwargs)}, expected exactly "
                             f"{self.axes}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank: coordinate {coord_kwargs} is outside dims "
                             f"{dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_coord(self, rank):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"get_coord: rank {rank} is outside this topology's world of "
                         f"{self.world_size()}")

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-"):
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes
                              if a not in omit_axes)

    def filter_match(self, **filter_kwargs):
        """The ranks whose coordinates match every given axis=value, in rank order."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match: unknown axes {sorted(unknown)}; axes are {self.axes}")
        return sorted(r for c, r in self.mapping.items()
                      if all(getattr(c, a) == v for a, v in filter_kwargs.items()))

    def get_axis_list(self, axis, idx):
        """The ranks at index idx of axis, in rank order."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis):
        """One list per combination of the other axes: the ranks that differ only along `axis`
        (the groups a collective over that axis runs in)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def __str__(self):
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """DeepSpeed's 3D layout. zeroshard has no tensor (model) parallelism: the engine refuses a
    model axis larger than 1."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


# ----- the grid's layout as pure functions (tested for every rank and world in one process) -----

def prime_factors(n):
    """n's prime factors in ascending order, repeated: 12 -> [2, 2, 3]."""
    if n < 1:
        raise ValueError(f"prime_factors: got {n}, expected a positive integer")
    factors, candidate = [], 2
    while n > 1:
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1
    return factors


_prime_factors = prime_factors  # DeepSpeed's name


def default_topology(world_size):
    """DeepSpeed's grid without a topology: world_size's prime factors dealt alternately to the
    pipe and data axes, the first to pipe (8 -> 4 stages x 2 replicas, 6 -> 2 x 3)."""
    num_pp = num_dp = 1
    for index, prime in enumerate(prime_factors(world_size)):
        if index % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


def model_parallel_lists(topology):
    """DeepSpeed's "model parallel" groups (the mpu's get_model_parallel_*): per data index, every
    rank holding it, i.e. all stages and tensor slices of one pipeline replica."""
    return [sorted(topology.get_axis_list("data", d)) for d in range(topology.get_dim("data"))]


def slice_parallel_lists(topology):
    """The tensor-slicing groups: along the model axis, or one group per rank without one."""
    if topology.get_dim("model") > 1:
        return topology.get_axis_comm_lists("model")
    return [[rank] for rank in range(topology.world_size())]


def p2p_pairs(topology):
    """Per global rank, [rank, the rank of the next stage in its pipeline]; the last stage's
    next is the first (DeepSpeed's grid.p2p_groups)."""
    next_rank = {}
    for ranks in topology.get_axis_comm_lists("pipe"):
        for i, rank in enumerate(ranks):
            next_rank[rank] = ranks[(i + 1) % len(ranks)]
    return [[rank, next_rank[rank]] for rank in range(topology.world_size())]


def _check_grid_topology(topology, world_size):
    axes = topology.get_axis_names()
    if "pipe" not in axes or "data" not in axes:
        raise ValueError(f"PipelineParallelGrid: the topology's axes are {axes}; a grid needs 'pipe' and 'data'")
    if topology.world_size() != world_size:
        raise ValueError(f"PipelineParallelGrid: the topology {dict(zip(axes, topology.dims))} holds "
                         f"{topology.world_size()} ranks, the world has {world_size}")


class PipelineParallelGrid:
    """DeepSpeed's grid over a topology for this rank (the mpu interface DeepSpeed and Megatron-style
    code read): its stage and data index, and its rank list and process group along each axis.

    As in DeepSpeed, `dp_group` / `pp_group` / `slice_group` are rank lists and the process groups
    are `dp_proc_group` / `pp_proc_group` / `slice_proc_group` (the get_*_group() methods return
    the process groups). "Model parallel" means DeepSpeed's: the ranks of one pipeline replica
    (every stage), so get_model_parallel_world_size() is stages x tensor slices. The slice groups
    follow a model axis; zeroshard's PipelineModule has none above 1 (no tensor slicing), which
    makes each slice group this rank alone, slice rank 0, as DeepSpeed's grid does."""

    def __init__(self, topology=None, process_group=None):
        import torch.distributed as dist
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # torch stands for a group this rank is not in by a negative int (GroupMember.NON_GROUP_MEMBER).
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup) and \
                process_group is not dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"PipelineParallelGrid: process_group must be a torch.distributed group, got "
                             f"{type(process_group).__name__} {process_group!r}")
        if process_group is not None:
            # DeepSpeed's grid ignores process_group and spans the world; this one spans the world
            # too, and refuses a group that says otherwise.
            members = dist.get_world_size(process_group)
            if members != self.world_size:
                held = ("does not hold this rank" if members < 0
                        else f"holds {members} of the world's {self.world_size} ranks")
                raise ValueError(f"PipelineParallelGrid: process_group {held}; the grid spans the whole world")
        self._topo = default_topology(self.world_size) if topology is None else topology
        _check_grid_topology(self._topo, self.world_size)
        self.data_parallel_size = self._topo.get_dim("data")
        self.pipe_parallel_size = self._topo.get_dim("pipe")
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = p2p_pairs(self._topo)

        # Every rank creates every group in the same order, as new_group requires; equal rank
        # lists share one group (without tensor slicing the model-parallel groups are the pipe's).
        self._made = {}
        self.ds_model_groups = model_parallel_lists(self._topo)
        ranks, self.ds_model_proc_group = self._groups_along(self.ds_model_groups)
        self.ds_model_rank, self.ds_model_world_size = ranks.index(self.global_rank), len(ranks)
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = self._groups_along(self.dp_groups)
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = self._groups_along(self.pipe_groups)
        self.model_groups = slice_parallel_lists(self._topo)
        self.slice_group, self.slice_proc_group = self._groups_along(self.model_groups)

    def _groups_along(self, lists):
        """Creates the process group of every list; returns this rank's list and group."""
        import torch.distributed as dist
        mine = None
        for ranks in lists:
            key = tuple(sorted(ranks))
            if key not in self._made:
                # One process: the world is every group (no subgroup to create).
                self._made[key] = dist.group.WORLD if self.world_size == 1 else dist.new_group(list(key))
            if self.global_rank in ranks:
                mine = (list(ranks), self._made[key])
        assert mine is not None, f"rank {self.global_rank} is in none of {lists}"
        return mine

    def _is_grid_valid(self):
        """DeepSpeed's check (its tests call it): the topology holds exactly the world's ranks."""
        return self._topo.world_size() == self.world_size

    def get_stage_id(self):
        return self._topo.get_coord(self.global_rank).pipe

    def get_data_parallel_id(self):
        return self._topo.get_coord(self.global_rank).data

    def stage_to_global(self, stage_id, **kwargs):
        """The global rank at stage_id (and any other axes given) with this rank's other coordinates."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self):
        return self._topo

    def get_global_rank(self):
        return self.global_rank

    # ----- pipe axis: the stages of this rank's pipeline -----
    def get_pipe_parallel_rank(self):
        return self.stage_id

    def get_pipe_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    # ----- data axis: this stage's replicas in every pipeline -----
    def get_data_parallel_rank(self):
        return self.data_parallel_id

    def get_data_parallel_world_size(self):
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    # ----- DeepSpeed's model parallelism: one whole pipeline replica (gradient norms, overflow) -----
    def get_model_parallel_rank(self):
        return self.ds_model_rank

    def get_model_parallel_world_size(self):
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    # ----- tensor slicing (Megatron-style): one rank per group in zeroshard -----
    def get_slice_parallel_rank(self):
        if "model" in self._topo.get_axis_names():
            return self._topo.get_coord(self.global_rank).model
        return 0

    def get_slice_parallel_world_size(self):
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group
