"""DeepSpeed's process topology (deepspeed.runtime.pipe.topology): ranks laid out on named axes,
the last axis varying fastest. PipeDataParallelTopology(num_pp, num_dp) puts global rank
stage * num_dp + data_index at coordinate (pipe=stage, data=data_index), so a stage's data
replicas are neighbours."""
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


class PipelineParallelGrid:
    """DeepSpeed's grid over a topology for one rank: its stage, its data index and the groups
    along each axis (the mpu interface Megatron-style code reads). Every rank builds the same
    groups in the same order, as torch.distributed.new_group requires."""

    def __init__(self, topology, global_rank):
        import torch.distributed as dist
        self._topo = topology
        self.global_rank = global_rank
        self.world_size = topology.world_size()
        coord = topology.get_coord(global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.pipe_parallel_size = topology.get_dim("pipe")
        self.data_parallel_size = topology.get_dim("data")
        self.dp_group = self.pp_group = None
        self.dp_ranks = self.pp_ranks = None
        for ranks in topology.get_axis_comm_lists("data"):
            group = dist.new_group(ranks) if self.world_size > 1 else dist.group.WORLD
            if global_rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks
        for ranks in topology.get_axis_comm_lists("pipe"):
            group = dist.new_group(ranks) if self.world_size > 1 else dist.group.WORLD
            if global_rank in ranks:
                self.pp_group, self.pp_ranks = group, ranks

    def topology(self):
        return self._topo

    def get_stage_id(self):
        return self.stage_id

    def get_data_parallel_id(self):
        return self.data_parallel_id

    def stage_to_global(self, stage_id, **kwargs):
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def get_global_rank(self):
        return self.global_rank

    def get_pipe_parallel_rank(self):
        return self.stage_id

    def get_pipe_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_group

    def get_data_parallel_rank(self):
        return self.data_parallel_id

    def get_data_parallel_world_size(self):
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_group

    # No tensor parallelism: the model-parallel axis is one rank (Megatron's mpu interface).
    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_slice_parallel_rank(self):
        return 0

    def get_slice_parallel_world_size(self):
        return 1
