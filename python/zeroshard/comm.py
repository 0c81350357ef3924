"""torch.distributed start-up from the usual environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), from SLURM or Open MPI variables, or as a world of one when none is set."""
import atexit
import datetime
import gc
import os
import socket
import sys
import weakref

import torch
import torch.distributed as dist

from zeroshard.launcher.discovery import discover_env

_DEFAULT_TIMEOUT_MIN = 30


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def timeout_seconds() -> float:
    # DEEPSPEED_TIMEOUT (minutes) is honoured so existing job scripts keep their setting.
    for key in ("ZEROSHARD_TIMEOUT", "DEEPSPEED_TIMEOUT"):
        if os.environ.get(key):
            try:
                return float(os.environ[key]) * 60.0
            except ValueError:
                raise ValueError(f"{key}: got {os.environ[key]!r}, expected a number of minutes")
    return _DEFAULT_TIMEOUT_MIN * 60.0


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """Starts torch.distributed once; later calls return at once (DeepSpeed's signature). Either
    way, the process group is destroyed at exit (_destroy_at_exit), also one that accelerate or
    the script started: the engine calls this before it uses the group."""
    if not _exit_teardown:
        _exit_teardown.append(atexit.register(_destroy_at_exit))
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialized")
    env = os.environ
    if rank >= 0 and world_size > 0:
        env["RANK"], env["WORLD_SIZE"] = str(rank), str(world_size)
    if "RANK" not in env or "WORLD_SIZE" not in env:
        found = discover_env(env) if auto_mpi_discovery else {}
        for k, v in found.items():
            env.setdefault(k, str(v))
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # No launcher: a world of one on this machine.
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(env["LOCAL_RANK"]) % torch.cuda.device_count())
    if backend.lower() == "gloo":  # a mixed "cpu:gloo,cuda:nccl" is left as torch sets it
        _torch_flight_recorder_off_unless_set(env)
    t = timeout if timeout is not None else datetime.timedelta(seconds=timeout_seconds())
    dist.init_process_group(backend=backend, init_method=init_method, timeout=t,
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))


# torch's names for its own c10d flight recorder's size (2000 entries when neither is set).
_TORCH_FLIGHT_RECORDER_KEYS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def _torch_flight_recorder_off_unless_set(env):
    """On a CPU run torch's recorder makes resident memory grow every step (README, "Where
    zeroshard deliberately differs from DeepSpeed"). torch reads the size once, when it first
    builds the recorder, so this runs before the first group exists."""
    if not any(key in env for key in _TORCH_FLIGHT_RECORDER_KEYS):
        env[_TORCH_FLIGHT_RECORDER_KEYS[0]] = "0"


_exit_teardown = []  # the handler, once registered
_holders = weakref.WeakSet()  # live objects whose C++ parts hold the group (engines)


def release_at_exit(holder):
    """`holder._release_runtime()` runs at exit before the group is destroyed, so that what holds
    the group is freed while the interpreter still runs (see _destroy_at_exit)."""
    _holders.add(holder)


def _destroy_at_exit():
    """The process group is torn down before the interpreter finalizes: Gloo's threads left
    running into exit() can abort a run that ended cleanly ("terminate called without an active
    exception"). Gloo's only: destroying an NCCL group with collectives still pending waits for
    them, which after a failed rank (whatever way its script exits) would be a hang at exit. Left
    alone too when the script destroyed it already or an exception ended the run."""
    if (dist.is_initialized() and dist.get_backend() == "gloo"
            and getattr(sys, "last_value", None) is None):
        # Every reference to the group goes first (the engines' communicators, ours), so its
        # threads are joined now and not when the process is already exiting.
        for holder in list(_holders):
            holder._release_runtime()
        _shared.clear()
        gc.collect()
        dist.destroy_process_group()


def new_comm(group=None):
    """A zeroshard communicator (numbered, watched collectives) over `group`, the world by default.
    Only the world's gets torch's default store, so that its errors name every rank."""
    from zeroshard import _C
    if group is None:
        return _C.Comm(dist.group.WORLD, timeout_seconds(),
                       store=dist.distributed_c10d._get_default_store())
    return _C.Comm(group, timeout_seconds(), debug_collectives=False)


_shared = {}


def shared_comm():
    """One communicator over the world for the script-facing helpers' own collectives
    (GatheredParameters on tensors no engine holds), built on first use in this world. Every
    rank reaches it at the same point, so the communicators' numbering stays aligned."""
    world = dist.group.WORLD
    if _shared.get("group") is not world:
        _shared.update(group=world, comm=new_comm())
    return _shared["comm"]


def device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# deepspeed.comm's most used helpers, for scripts that call them.
def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None):
    if dist.is_initialized():
        dist.barrier(group)
