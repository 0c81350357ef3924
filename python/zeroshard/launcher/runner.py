# `zeroshard [options] script.py [script args]`: DeepSpeed's launcher flags, a hostfile, and one
# per-node spawner per host (locally, over ssh / pdsh, or one mpirun / srun). Stdlib only: no torch.
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

if not __package__:  # run by path: load this folder as a package, skipping zeroshard/__init__ (torch)
    import importlib.util
    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "zeroshard_launcher", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here])
    if _spec.name not in sys.modules:
        sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_spec.name])
    __package__ = _spec.name

from . import backends
from .backends import Job
from .envfile import ENV_FILE_NAMES, EnvFileError, collect_exports
from .hostfile import HostfileError, select_resources
# The host flags and helpers `zeroshard check` shares (hosts.py), here under their old names too
# (fetch_hostfile and DLTS_HOSTFILE under DeepSpeed's runner's, which GPT-NeoX imports).
from .hosts import (DEFAULT_HOSTFILE, DEFAULT_PORT, LaunchError, add_host_arguments,  # noqa: F401
                    fetch_hostfile, glue_launcher_args, rendezvous_port, resource_pool)
from .nodes import NodeProcess, run_nodes

# DeepSpeed's name for the per-user exports file (accelerate's launcher writes to it).
DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]
DLTS_HOSTFILE = DEFAULT_HOSTFILE
LAUNCHERS = ("ssh", "pdsh", "openmpi", "slurm")


def parse_inclusion_exclusion(resource_pool, inclusion, exclusion):
    """DeepSpeed's (GPT-NeoX imports it): {host: [slots]} of `resource_pool` ({host: slots})
    after --include / --exclude."""
    return select_resources(resource_pool, include=inclusion, exclude=exclusion)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard",
        description="Start a zeroshard (or DeepSpeed) training script on one or many hosts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_host_arguments(p)
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh")
    p.add_argument("--no_ssh", action="store_true",
                   help="run only this node's ranks (the same command runs on every node)")
    p.add_argument("--launcher", default="ssh", choices=LAUNCHERS)
    p.add_argument("--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script as a program, not via python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N")
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="write each rank's output to DIR/rank_<rank>.log instead of the console")
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="give each rank an equal share of the cores; sets OMP_NUM_THREADS")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the ssh reachability check")
    p.add_argument("--save_pid", action="store_true",
                   help="write this launcher's pid to /tmp/<pid>.zeroshard while it runs")
    p.add_argument("user_script", help="training script (or module / program)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def check_reachable(job: Job, hosts: list[str]) -> None:
    checks = {h: subprocess.Popen(backends.ssh_check_argv(job, h), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for h in hosts}
    problems = []
    for host, proc in checks.items():
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            err, proc.returncode = "timed out after 30 s", -1
        if proc.returncode != 0:
            last = (err.strip().splitlines() or ["no message"])[-1]
            problems.append(f'cannot reach host "{host}" over ssh ({last}); '
                            f"try: {shlex.join(backends.ssh_check_argv(job, host))}")
    if problems:
        raise LaunchError("\n".join(problems) + "\n(passwordless ssh to every host is needed; "
                          "--no_ssh_check skips this check)")


def find_master_addr(job: Job, host: str) -> str:
    argv = backends.ssh_hostname_argv(job, host)
    try:
        out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` timed out; pass --master_addr") from None
    addrs = out.stdout.split()
    if out.returncode != 0 or not addrs:
        raise LaunchError(f"could not find {host}'s address: `{shlex.join(argv)}` exited "
                          f"{out.returncode} {out.stderr.strip()!r}; pass --master_addr")
    return addrs[0]


def _need(program: str, launcher: str) -> None:
    if shutil.which(program) is None:
        raise LaunchError(f"--launcher {launcher} needs `{program}` on PATH, and it is not there")


def plan(args: argparse.Namespace) -> tuple[list[NodeProcess], list[str]]:
    """The node processes to run, and temporary files to remove afterwards."""
    if args.no_ssh and args.node_rank < 0:
        raise LaunchError("--no_ssh needs --node_rank (this node's index in the hostfile)")
    if args.node_rank >= 0 and not args.no_ssh:
        raise LaunchError("--node_rank is only used with --no_ssh")
    pool, from_hostfile = resource_pool(args)
    cwd = os.getcwd()
    job = Job(python=sys.executable, script=args.user_script, script_args=list(args.user_args),
              cwd=cwd, exports=collect_exports(dict(os.environ), cwd), master_addr=args.master_addr,
              master_port=DEFAULT_PORT if args.master_port is None else args.master_port,
              module=args.module, no_python=args.no_python,
              no_local_rank=args.no_local_rank, each_rank_log=args.enable_each_rank_log,
              bind_cores_to_rank=args.bind_cores_to_rank,
              launcher_args=shlex.split(args.launcher_args), ssh_port=args.ssh_port)
    if args.launcher == "slurm" and not from_hostfile and not args.no_ssh:
        # Inside an allocation: srun places the tasks; each takes MASTER_ADDR from SLURM_STEP_NODELIST.
        if args.include or args.exclude:
            raise LaunchError("--launcher slurm without a hostfile takes --num_nodes/--num_gpus, "
                              "not --include/--exclude")
        _need("srun", "slurm")
        argv = backends.slurm_argv(job, max(1, args.num_nodes), max(1, args.num_gpus), None)
        return [NodeProcess("srun", argv, dict(os.environ), False)], []
    resources = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    hosts = list(resources)
    multi = (len(hosts) > 1 or args.force_multi) and not args.no_ssh

    # One machine alone picks a free port, as torchrun --standalone does; nodes must agree, so
    # they take the default unless told otherwise.
    alone = not multi and not args.no_ssh
    job.master_port = rendezvous_port(args.master_port, alone)
    if not multi:  # this machine runs (its share of) the ranks itself, without ssh
        node_rank = args.node_rank if args.no_ssh else 0
        if node_rank >= len(hosts):
            raise LaunchError(f"--node_rank {node_rank}: the job has {len(hosts)} hosts ({', '.join(hosts)})")
        if not job.master_addr:
            job.master_addr = "127.0.0.1" if len(hosts) == 1 else hosts[0]
        argv = backends.spawner_argv(job, backends.encode_world_info(resources), node_rank)
        env = dict(os.environ, **job.exports)
        return [NodeProcess(f"node {node_rank} ({hosts[node_rank]})", argv, env, True)], []

    if args.launcher in ("ssh", "pdsh", "openmpi") and not args.no_ssh_check:
        check_reachable(job, hosts)
    if not job.master_addr and args.launcher != "slurm":
        job.master_addr = find_master_addr(job, hosts[0])
    env = dict(os.environ)
    if args.launcher == "ssh":
        info = backends.encode_world_info(resources)
        return [NodeProcess(f"node {i} ({h})", backends.ssh_node_argv(job, info, i, h), env, True)
                for i, h in enumerate(hosts)], []
    if args.launcher == "pdsh":
        _need("pdsh", "pdsh")
        argv, pdsh_env = backends.pdsh_argv(job, resources)
        return [NodeProcess("pdsh", argv, dict(env, **pdsh_env), False)], []
    if any(s != list(range(len(s))) for s in resources.values()):
        raise LaunchError(f"--launcher {args.launcher} starts slots 0..n-1 on each host; "
                          "slot lists in --include/--exclude need --launcher ssh or pdsh")
    if args.launcher == "openmpi":
        _need("mpirun", "openmpi")
        fd, path = tempfile.mkstemp(prefix="zeroshard-hostfile-")
        with os.fdopen(fd, "w") as f:
            f.write(backends.openmpi_hostfile_text(resources))
        return [NodeProcess("mpirun", backends.openmpi_argv(job, resources, path), env, False)], [path]
    _need("srun", "slurm")
    per_node = {len(s) for s in resources.values()}
    if len(per_node) != 1:
        raise LaunchError("--launcher slurm needs the same number of slots on every host "
                          "(use --num_gpus)")
    argv = backends.slurm_argv(job, len(hosts), per_node.pop(), hosts)
    return [NodeProcess("srun", argv, env, False)], []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `zeroshard plan ...` (the memory planner) and `zeroshard check ...` (the preflight check).
    if argv[:1] == ["plan"]:
        from zeroshard.planner.cli import main as plan_main
        return plan_main(argv[1:])
    if argv[:1] == ["check"]:
        from .check import main as check_main
        return check_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(glue_launcher_args(argv, parser))
    if args.user_args[:1] == ["--"]:
        args.user_args = args.user_args[1:]
    try:
        nodes, temp_files = plan(args)
    except (LaunchError, HostfileError, EnvFileError, OSError) as e:
        print(f"zeroshard: {e}", file=sys.stderr)
        return 1
    try:
        pid_file = f"/tmp/{os.getpid()}.zeroshard" if args.save_pid else None
        return run_nodes(nodes, pid_file)
    finally:
        for path in temp_files:
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
