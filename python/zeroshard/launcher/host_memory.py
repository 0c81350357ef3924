# What `zeroshard check` reads from a ds_config: the host memory each node needs, as the memory
# planner (zeroshard.planner, the one owner of that arithmetic) counts it, and the NVMe paths to probe.
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    """What the memory column checks against: need ({ranks on a host: host bytes the node needs},
    None when not planned: the check is skipped), the note printed under the table, and error
    (set when the planner itself failed: every host's memory check fails, naming it)."""
    need: dict[int, int] | None
    note: str
    error: str = ""


def host_bytes_by_ranks_per_node(config: dict, num_params: float | None, ranks_per_node: list[int]) -> MemoryPlan:
    """The host memory each node needs for `config`, as the planner counts it. Not planned without
    num_params or without torch on this machine; a config the planner rejects raises its
    ValueError (the user's to fix); any other failure of the planner is an error of the check."""
    if num_params is None:
        return MemoryPlan(None, "memory: skipped (not planned): pass --num_params (the model's parameter count, "
                                "e.g. 7e9) to check each host's MemAvailable against the planned setup")
    try:
        # Here, not at the top: the launcher package imports without torch; the planner needs it.
        from zeroshard.planner import host_bytes_per_node
    except ImportError as e:
        if e.name == "torch":
            return MemoryPlan(None, f"memory: skipped (not planned): the planner needs torch, which this "
                                    f"machine cannot import ({e})")
        return _failed(e)
    world, need = sum(ranks_per_node), {}
    try:
        for ranks in set(ranks_per_node):
            if world % ranks == 0:
                need[ranks] = host_bytes_per_node(config, int(num_params), ranks, world // ranks)
            else:  # the planner's nodes are alike: count this host as `ranks` one-rank nodes of the world
                need[ranks] = ranks * host_bytes_per_node(config, int(num_params), 1, world)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug of the planner: the table still comes, with it named
        return _failed(e)
    return MemoryPlan(need, f"memory: planned by zeroshard.planner for {num_params:g} parameters over "
                            f"{world} rank{'s' if world != 1 else ''}")


def _failed(e: BaseException) -> MemoryPlan:
    why = f"the planner failed ({type(e).__name__}: {e}), so the host memory could not be checked"
    return MemoryPlan(None, f"memory: {why}", why)


def _device(block: dict) -> str:
    return str(block.get("device", "none") or "none").lower()


def nvme_paths(config: dict) -> dict[str, str]:
    """{config key: path} for each block that offloads to NVMe."""
    zero = config.get("zero_optimization") or {}
    out = {}
    for block in ("offload_optimizer", "offload_param"):
        b = zero.get(block) or {}
        if _device(b) == "nvme":
            out[f"zero_optimization.{block}.nvme_path"] = str(b.get("nvme_path") or "")
    return out
