"""deepspeed.zero.GatheredParameters: whole parameters for the length of a `with` block under
ZeRO-3, and, with modifier_rank, that rank's edits kept by everyone afterwards."""
import torch
import torch.distributed as dist


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params
                       if getattr(getattr(p, "_zeroshard_core", None), "partitions_params", False)]
        if modifier_rank is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                    or not 0 <= modifier_rank < world):
                raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank!r}): expected "
                                 f"None or a rank in 0..{world - 1}")
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        # Parameters that are not partitioned (stages 0-2, frozen ones) are whole already.

    def _by_core(self):
        groups = {}
        for p in self.params:
            groups.setdefault(id(p._zeroshard_core), (p._zeroshard_core, []))[1].append(p)
        return groups.values()

    def __enter__(self):
        if self.enabled:
            for core, params in self._by_core():
                core.fetch_params([p._zeroshard_index for p in params])
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for core, params in self._by_core():
            indices = [p._zeroshard_index for p in params]
            if self.modifier_rank is not None and exc[0] is None:
                for i in indices:  # broadcast by the engine's communicator, numbered and watched
                    core.write_back(i, self.modifier_rank)
            core.release_params(indices)
        return False
