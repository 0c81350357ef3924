# Rank discovery for processes started by srun (SLURM_*) or mpirun (OMPI_COMM_WORLD_*) instead of the
# zeroshard launcher, so `srun python train.py` works. Pure functions over an environment mapping.
from __future__ import annotations

import os
import re
from typing import Iterator, Mapping

DEFAULT_MASTER_PORT = "29500"


class DiscoveryError(RuntimeError):
    """The environment names a scheduler but lacks what is needed to reach rank 0."""


def _expand_ranges(body: str, text: str) -> list[str]:
    """`01-03,7` -> ["01", "02", "03", "7"]; a range keeps the zero padding of its lower bound."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DiscoveryError(f'bad SLURM nodelist "{text}": range "{item}"')
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise DiscoveryError(f'bad SLURM nodelist "{text}": range "{item}" runs backwards')
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DiscoveryError(f'bad SLURM nodelist "{text}": unmatched ]')
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise DiscoveryError(f'bad SLURM nodelist "{text}": unmatched [')
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(pattern: str, text: str) -> Iterator[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        yield pattern
        return
    head, tail = pattern[:m.start()], pattern[m.end():]
    for value in _expand_ranges(m.group(1), text):
        for rest in _expand_one(tail, text):  # several bracket groups: their product, in order
            yield head + value + rest


def expand_nodelist(text: str) -> list[str]:
    """Expand SLURM's compressed host list: `node[01-03,7],gpu-a` -> node01 node02 node03 node7 gpu-a."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        hosts.extend(_expand_one(part, text))
    return hosts


def _slurm_local_size(env: Mapping[str, str], world_size: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": tasks on node 0..2 are 2, on node 3 it is 1.
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = int(env.get("SLURM_NODEID", "0"))
    if counts:
        per_node: list[int] = []
        for item in counts.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
            if not m:
                per_node = []
                break
            per_node.extend([int(m.group(1))] * int(m.group(2) or 1))
        if node_id < len(per_node):
            return per_node[node_id]
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return max(1, world_size // max(1, int(nnodes)))


def _from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    world_size = int(env.get("SLURM_NTASKS") or env["SLURM_NPROCS"])
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        # Task 0 of a step runs on the first node of the step's list.
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise DiscoveryError("SLURM environment found (SLURM_PROCID is set) but no SLURM_STEP_NODELIST "
                                 "or SLURM_NODELIST: set MASTER_ADDR to the address of rank 0's host")
        master_addr = expand_nodelist(nodelist)[0]
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_SIZE": str(_slurm_local_size(env, world_size)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": env.get("MASTER_PORT") or DEFAULT_MASTER_PORT,
    }


def _from_ompi(env: Mapping[str, str]) -> dict[str, str]:
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        raise DiscoveryError(
            "Open MPI environment found (OMPI_COMM_WORLD_RANK is set) but MASTER_ADDR is not: "
            "pass the address of rank 0's host, e.g. `mpirun -x MASTER_ADDR=<host> ...`")
    return {
        "RANK": env["OMPI_COMM_WORLD_RANK"],
        "WORLD_SIZE": env["OMPI_COMM_WORLD_SIZE"],
        "LOCAL_RANK": env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        "LOCAL_SIZE": env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": env.get("MASTER_PORT") or DEFAULT_MASTER_PORT,
    }


def discover_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT (strings) derived from an
    Open MPI or SLURM environment; {} when RANK is already set (it wins) or no scheduler applies.
    mpirun's variables are checked first: they are set per process even inside a SLURM allocation."""
    if "RANK" in environ:
        return {}
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        return _from_ompi(environ)
    if "SLURM_PROCID" in environ and ("SLURM_NTASKS" in environ or "SLURM_NPROCS" in environ):
        return _from_slurm(environ)
    return {}
