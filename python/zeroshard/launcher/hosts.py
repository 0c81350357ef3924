"""How a job's hosts are picked and reached, shared by the launcher (runner.py) and the preflight
check (check.py): the host-selection flags, the hostfile's resource pool, the rendezvous port, and
the gluing of --launcher_args. Stdlib only: no torch."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from .devices import local_gpu_ids
from .discovery import DEFAULT_MASTER_PORT
from .hostfile import parse_hostfile

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_PORT = int(DEFAULT_MASTER_PORT)  # for nodes that must agree on one without talking


class LaunchError(Exception):
    """A problem the user can fix; printed as `zeroshard: <message>`, exit status 1."""


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that pick hosts, slots and the rendezvous: the launcher's, and `zeroshard check`'s."""
    p.add_argument("-H", "--hostfile", default=None,
                   help=f'"<host> slots=<n>" per line (default {DEFAULT_HOSTFILE}; '
                        "absent: this machine only)")
    p.add_argument("-i", "--include", default="", help="hosts/slots to use, e.g. worker-0@worker-1:0,2")
    p.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out, same syntax")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="ranks per host (slots 0..N-1); without GPUs, N CPU processes per host")
    p.add_argument("--master_addr", default="", help="rank 0's address (found when absent)")
    p.add_argument("--master_port", type=int, default=None,
                   help=f"rendezvous port (default: a free one for a run on this machine alone, "
                        f"{DEFAULT_PORT} across nodes)")
    p.add_argument("--launcher_args", default="",
                   help="extra arguments for ssh / pdsh / mpirun / srun, shell-split")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--force_multi", action="store_true",
                   help="use the multi-node path (ssh) even for a single host")


def _warn(text: str) -> None:
    print(f"zeroshard: warning: {text}", file=sys.stderr, flush=True)


def fetch_hostfile(path: str) -> dict[str, int] | None:
    """{host: slots} from the hostfile at `path`, or None when there is no such file (DeepSpeed's
    runner function of this name, which GPT-NeoX imports)."""
    return parse_hostfile(path) if os.path.isfile(path) else None


def resource_pool(args: argparse.Namespace) -> tuple[dict[str, list[int]], bool]:
    """({host: [slots]}, from_hostfile)."""
    path = args.hostfile or DEFAULT_HOSTFILE
    pool = fetch_hostfile(path)
    if pool is not None:
        return {h: list(range(n)) for h, n in pool.items()}, True
    if args.hostfile is not None:
        raise LaunchError(f"hostfile {path} not found")
    _warn(f"no hostfile at {DEFAULT_HOSTFILE}; running on this machine only")
    gpus = local_gpu_ids()
    return {"localhost": gpus if gpus is not None else [0]}, False


def rendezvous_port(asked: int | None, alone: bool) -> int:
    """The port rank 0's store listens on. On this machine alone: a free one when none was asked
    for, and an asked-for port that something already holds is an error naming it."""
    if not alone:
        return DEFAULT_PORT if asked is None else asked
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds
        try:
            s.bind(("", 0 if asked is None else asked))
        except OSError as e:
            raise LaunchError(f"--master_port {asked}: the port is in use on this machine ({e.strerror}; "
                              "another job's rendezvous?); pass a free port, or leave --master_port out "
                              "and a free one is picked") from None
        return s.getsockname()[1]


def glue_launcher_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--launcher_args "-i key"` -> `--launcher_args=-i key`: argparse would take a value starting
    with '-' for an option. Only the launcher's own options (before the script) are looked at."""
    takes_value = {s for a in parser._actions if a.nargs is None and a.option_strings
                   and not isinstance(a, (argparse._StoreTrueAction, argparse._HelpAction))
                   for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--launcher_args" and i + 1 < len(argv):
            out.append(f"--launcher_args={argv[i + 1]}")
            i += 2
            continue
        if not token.startswith("-") or token == "--":
            return out + argv[i:]       # the script and its arguments: untouched
        out.append(token)
        if token in takes_value and i + 1 < len(argv):
            out.append(argv[i + 1])
            i += 1
        i += 1
    return out
