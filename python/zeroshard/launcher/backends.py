# Command builders: the exact argv each backend runs (ssh, pdsh, openmpi, slurm) and the per-node
# spawner's own argv. Pure functions; every piece that reaches a remote shell goes through shlex.quote.
from __future__ import annotations

import base64
import json
import os
import shlex
from dataclasses import dataclass, field

# The spawner runs by path (the same on every node, like the interpreter): that skips
# zeroshard/__init__, which imports torch, so a node's spawner starts in milliseconds.
SPAWNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
SSH_CHECK_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


@dataclass
class Job:
    """Everything a backend needs to start one job."""
    python: str                            # interpreter path, the same on every node
    script: str                            # user script, module name (--module) or program (--no_python)
    script_args: list[str]
    cwd: str
    exports: dict[str, str]                # set on every rank of every node
    master_addr: str
    master_port: int
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    launcher_args: list[str] = field(default_factory=list)
    ssh_port: int | None = None


def encode_world_info(resources: dict[str, list[int]]) -> str:
    text = json.dumps([[h, s] for h, s in resources.items()])  # a list keeps the rank order explicit
    return base64.urlsafe_b64encode(text.encode()).decode()


def decode_world_info(blob: str) -> dict[str, list[int]]:
    return {h: list(s) for h, s in json.loads(base64.urlsafe_b64decode(blob.encode()))}


def _script_flags(job: Job) -> list[str]:
    flags = []
    if job.module:
        flags.append("--module")
    if job.no_python:
        flags.append("--no_python")
    if job.no_local_rank:
        flags.append("--no_local_rank")
    if job.bind_cores_to_rank:
        flags.append("--bind_cores_to_rank")
    if job.each_rank_log:
        flags.append(f"--enable_each_rank_log={job.each_rank_log}")
    return flags + ["--", job.script] + list(job.script_args)


def spawner_argv(job: Job, world_info: str, node_rank: int | str, watch_stdin: bool = True) -> list[str]:
    """`python -u .../zeroshard/launcher/launch.py ...` for one node; node_rank may be pdsh's `%n`."""
    argv = [job.python, "-u", SPAWNER_PATH, f"--world_info={world_info}",
            f"--node_rank={node_rank}", f"--master_addr={job.master_addr}",
            f"--master_port={job.master_port}"]
    if watch_stdin:
        argv.append("--watch_stdin")
    return argv + _script_flags(job)


def remote_shell_command(job: Job, argv: list[str]) -> str:
    """The one string a remote login shell runs: cd to the launch directory, set the exports, exec."""
    env = [f"{k}={v}" for k, v in job.exports.items()]
    parts = ["exec", "env"] + env + argv if env else ["exec"] + argv
    return f"cd {shlex.quote(job.cwd)} && " + shlex.join(parts)


def ssh_base(job: Job) -> list[str]:
    port = ["-p", str(job.ssh_port)] if job.ssh_port else []
    return ["ssh"] + port + list(job.launcher_args)


def ssh_check_argv(job: Job, host: str) -> list[str]:
    return ["ssh"] + SSH_CHECK_OPTIONS + (["-p", str(job.ssh_port)] if job.ssh_port else []) \
        + list(job.launcher_args) + [host, "true"]


def ssh_hostname_argv(job: Job, host: str) -> list[str]:
    return ["ssh"] + SSH_CHECK_OPTIONS + (["-p", str(job.ssh_port)] if job.ssh_port else []) \
        + list(job.launcher_args) + [host, "hostname", "-I"]


def ssh_node_argv(job: Job, world_info: str, node_rank: int, host: str) -> list[str]:
    """ssh to one host and run its spawner. No -t: without a tty the remote spawner sees EOF on stdin
    when this connection drops, and ends its ranks."""
    command = remote_shell_command(job, spawner_argv(job, world_info, node_rank))
    return ssh_base(job) + ["-o", "BatchMode=yes", host, command]


def pdsh_argv(job: Job, resources: dict[str, list[int]]) -> tuple[list[str], dict[str, str]]:
    """One pdsh for all hosts; pdsh substitutes %n with each host's position in -w (= node rank).
    pdsh keeps no stdin to the remote side: the spawners notice a dropped connection by their parent."""
    world_info = encode_world_info(resources)
    command = remote_shell_command(job, spawner_argv(job, world_info, "%n", watch_stdin=False))
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if job.ssh_port:
        env["PDSH_SSH_ARGS_APPEND"] = f"-p {job.ssh_port}"
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(resources)] + list(job.launcher_args) \
        + [command], env


def _from_env_argv(job: Job) -> list[str]:
    """Each MPI / srun task runs the spawner in --from_env mode: it reads its rank from the scheduler's
    variables (discovery.py), sets RANK/LOCAL_RANK/... and execs the script with --local_rank."""
    return [job.python, "-u", SPAWNER_PATH, "--from_env"] + _script_flags(job)


def openmpi_argv(job: Job, resources: dict[str, list[int]], hostfile_path: str) -> list[str]:
    total = sum(len(s) for s in resources.values())
    argv = ["mpirun", "-n", str(total), "-hostfile", hostfile_path, "--mca", "btl", "^openib",
            "--tag-output", "-wdir", job.cwd]
    if job.ssh_port:
        argv += ["--mca", "plm_rsh_args", f"-p {job.ssh_port}"]
    argv += list(job.launcher_args)
    exports = dict(job.exports, MASTER_ADDR=job.master_addr, MASTER_PORT=str(job.master_port))
    for k, v in exports.items():
        argv += ["-x", f"{k}={v}"]
    return argv + _from_env_argv(job)


def openmpi_hostfile_text(resources: dict[str, list[int]]) -> str:
    return "".join(f"{h} slots={len(s)}\n" for h, s in resources.items())


def slurm_argv(job: Job, num_nodes: int, procs_per_node: int, nodelist: list[str] | None) -> list[str]:
    """srun runs argv directly (no shell): the exports travel as `env K=V` words, which keeps values
    holding commas intact (srun --export would split them)."""
    argv = ["srun", "-n", str(num_nodes * procs_per_node), f"--nodes={num_nodes}",
            f"--ntasks-per-node={procs_per_node}", "--label", f"--chdir={job.cwd}"]
    if nodelist:
        argv.append(f"--nodelist={','.join(nodelist)}")
    argv += list(job.launcher_args)
    exports = dict(job.exports, MASTER_PORT=str(job.master_port))
    if job.master_addr:  # else each task takes the first host of SLURM_STEP_NODELIST
        exports["MASTER_ADDR"] = job.master_addr
    return argv + ["env"] + [f"{k}={v}" for k, v in exports.items()] + _from_env_argv(job)
