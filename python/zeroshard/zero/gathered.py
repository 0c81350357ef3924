"""deepspeed.zero.GatheredParameters: whole parameters for the length of a `with` block under
ZeRO-3, and, with modifier_rank, that rank's edits kept by everyone afterwards.

Four kinds of tensor take part: those an engine partitions (its gatherer gathers them), those
zero.Init partitioned before any engine exists (gathered here, on zero.Init's communicator: how
Hugging Face initializes and loads a model under ZeRO-3), those an engine holds whole at stages
0-2 (already whole; with modifier_rank that rank's edit is broadcast into every rank's master and
model copies, where it would otherwise stay on one rank or be overwritten by the next step), and
any other tensor, whole on every rank (with modifier_rank, broadcast from that rank so that
replicas stay equal; DeepSpeed leaves them alone). The write-back happens even when the block
raises, as in DeepSpeed: whether a rank raised is its own affair, and every rank must issue the
same collectives."""
import torch
import torch.distributed as dist

from zeroshard.zero.hooks import register_external_parameter
from zeroshard.zero.partition_init import (gather_before_engine, init_comm,
                                           partitioned_before_engine, repartition_before_engine)


def _core(p):
    return getattr(p, "_zeroshard_core", None)


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.modifier_rank, self.enabled = modifier_rank, enabled
        if not enabled:
            return
        if isinstance(params, torch.Tensor):
            params = [params]
        # Once each (tied weights are listed twice); None entries (bias=None) are skipped.
        params = list({id(p): p for p in ([] if params is None else params) if p is not None}.values())
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise ValueError(f"GatheredParameters: expected parameters (tensors), got a {bad[0]}; "
                             "pass module.parameters(), a list of them, or one parameter")
        self.engine = [p for p in params if _core(p) is not None and _core(p).strategy.partitions_params]
        self.before_engine = [p for p in params if partitioned_before_engine(p)]
        held = {id(p) for p in self.engine + self.before_engine}
        self.whole = [p for p in params if _core(p) is not None and id(p) not in held]
        self.other = [p for p in params if _core(p) is None and id(p) not in held]
        if modifier_rank is not None:
            self._check_rank(modifier_rank)
        if fwd_module is not None:
            # DeepSpeed's meaning: the parameters are used in fwd_module's forward from now on.
            for p in self.engine + self.before_engine:
                register_external_parameter(fwd_module, p)

    def _check_rank(self, rank):
        """modifier_rank must be a rank of every communicator the block broadcasts on."""
        worlds = {init_comm(p).world_size for p in self.before_engine}
        worlds.add(dist.get_world_size() if dist.is_initialized() else 1)
        world = min(worlds)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"GatheredParameters(modifier_rank={rank!r}): expected None or a "
                             f"rank in 0..{world - 1}")

    def _by_core(self, params):
        groups = {}
        for p in params:
            groups.setdefault(id(p._zeroshard_core), (p._zeroshard_core, []))[1].append(p)
        return groups.values()

    def __enter__(self):
        if not self.enabled:
            return self
        for core, params in self._by_core(self.engine):
            core.gatherer.fetch_params([p._zeroshard_index for p in params])
        gather_before_engine(self.before_engine)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        keep = self.modifier_rank
        for core, params in self._by_core(self.engine):
            indices = [p._zeroshard_index for p in params]
            if keep is not None:
                for i in indices:  # broadcast by the engine's communicator, numbered and watched
                    core.gatherer.write_back(i, keep)
            core.gatherer.release_params(indices)
        repartition_before_engine(self.before_engine, keep)
        if keep is not None:
            for p in self.whole:
                p._zeroshard_core.full_values.set(p._zeroshard_index, "fp32_param", p.detach(),
                                                 src_rank=keep)
            if self.other and dist.is_initialized() and dist.get_world_size() > 1:
                from zeroshard.comm import shared_comm
                comm = shared_comm()
                with torch.no_grad():
                    for p in self.other:
                        values = p.data.contiguous()
                        comm.broadcast(values, keep, f"GatheredParameters: tensor {tuple(p.shape)}")
                        if values.data_ptr() != p.data.data_ptr():
                            p.data.copy_(values)
        return False
