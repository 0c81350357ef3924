"""deepspeed.zero.GatheredParameters: whole parameters for the length of a `with` block under
ZeRO-3, and, with modifier_rank, that rank's edits kept by everyone afterwards.

Three kinds of parameter take part: those an engine partitions (its coordinator gathers them),
those zero.Init partitioned before any engine exists (gathered here, on zero.Init's
communicator: how Hugging Face initializes and loads a model under ZeRO-3), and those an engine
holds whole at stages 0-2 (already whole; with modifier_rank that rank's edit is broadcast into
every rank's master and model copies, where it would otherwise stay on one rank or be overwritten
by the next step). A tensor no engine holds and zero.Init did not partition is whole already and
is left as it is, as in DeepSpeed."""
import torch
import torch.distributed as dist

from zeroshard.zero.hooks import register_external_parameter
from zeroshard.zero.partition_init import (gather_before_engine, partitioned_before_engine,
                                           repartition_before_engine)


def _core(p):
    return getattr(p, "_zeroshard_core", None)


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = [] if params is None else list(params)
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise ValueError(f"GatheredParameters: expected parameters (tensors), got a {bad[0]}; "
                             "pass module.parameters(), a list of them, or one parameter")
        if modifier_rank is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                    or not 0 <= modifier_rank < world):
                raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank!r}): expected "
                                 f"None or a rank in 0..{world - 1}")
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.engine = [p for p in params if _core(p) is not None and _core(p).partitions_params]
        self.before_engine = [p for p in params if partitioned_before_engine(p)]
        self.whole = [p for p in params if _core(p) is not None and not _core(p).partitions_params]
        if fwd_module is not None and enabled:
            # DeepSpeed's meaning: the parameters are used in fwd_module's forward from now on.
            for p in self.engine + self.before_engine:
                register_external_parameter(fwd_module, p)
        self._chunks = None

    def _by_core(self, params):
        groups = {}
        for p in params:
            groups.setdefault(id(p._zeroshard_core), (p._zeroshard_core, []))[1].append(p)
        return groups.values()

    def __enter__(self):
        if not self.enabled:
            return self
        for core, params in self._by_core(self.engine):
            core.fetch_params([p._zeroshard_index for p in params])
        self._chunks = gather_before_engine(self.before_engine)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        keep = self.modifier_rank if exc[0] is None else None
        for core, params in self._by_core(self.engine):
            indices = [p._zeroshard_index for p in params]
            if keep is not None:
                for i in indices:  # broadcast by the engine's communicator, numbered and watched
                    core.write_back(i, keep)
            core.release_params(indices)
        repartition_before_engine(self.before_engine, self._chunks, keep)
        if keep is not None:
            for p in self.whole:
                p._zeroshard_core.set_full_value(p._zeroshard_index, "fp32_param", p.detach(),
                                                 src_rank=keep)
        return False
