# What `zeroshard check` reads from a ds_config: the host memory each node needs, as the memory
# planner (zeroshard.planner, the one owner of that arithmetic) counts it, and the NVMe paths to probe.
from __future__ import annotations


def host_bytes_by_ranks_per_node(config: dict, num_params: float | None,
                                 ranks_per_node: list[int]) -> tuple[dict[int, int] | None, str]:
    """({ranks on a node: host bytes the node needs}, a note for the output), or (None, why not)
    when the need cannot be planned. A config the planner rejects raises its ValueError."""
    if num_params is None:
        return None, ("memory: not planned: pass --num_params (the model's parameter count, e.g. 7e9) to "
                      "check each host's MemAvailable against the planned setup")
    try:
        # Here, not at the top: the launcher package imports without torch; the planner needs it.
        from zeroshard.planner import host_bytes_per_node
    except ImportError as e:
        return None, f"memory: not planned: the planner cannot be imported on this machine ({e})"
    world, need = sum(ranks_per_node), {}
    try:
        for ranks in set(ranks_per_node):
            if world % ranks == 0:
                need[ranks] = host_bytes_per_node(config, int(num_params), ranks, world // ranks)
            else:  # the planner's nodes are alike: count this host as `ranks` one-rank nodes of the world
                need[ranks] = ranks * host_bytes_per_node(config, int(num_params), 1, world)
    except ValueError:
        raise  # the config or the count: the user's to fix
    except Exception as e:  # the table must still come: say the memory could not be planned, and why
        return None, f"memory: not planned: the planner failed ({type(e).__name__}: {e})"
    return need, (f"memory: planned by zeroshard.planner for {num_params:g} parameters over "
                  f"{world} rank{'s' if world != 1 else ''}")


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
