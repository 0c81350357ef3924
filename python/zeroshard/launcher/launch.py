# Per-node spawner: `python -u <package>/zeroshard/launcher/launch.py --world_info=... --node_rank=N script`.
# Starts this node's ranks, prefixes their output, and ends all of them (and anything they started)
# when one fails, when it is signalled, or when the connection to the launcher drops.
from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time

if not __package__:  # run by path: load this folder as a package, skipping zeroshard/__init__ (torch)
    import importlib.util
    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "zeroshard_launcher", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here])
    if _spec.name not in sys.modules:
        sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_spec.name])
    __package__ = _spec.name

from . import procs
from .backends import decode_world_info
from .devices import local_gpu_ids
from .discovery import DiscoveryError, discover_env

KILL_GRACE_S = 3.0       # SIGTERM (or the forwarded signal), then SIGKILL after this long
PARENT_POLL_S = 0.2
FAILURE_MARK = "zeroshard: rank"  # the runner parses these lines (see runner.FAILURE_RE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zeroshard/launcher/launch.py",
                                description="zeroshard per-node spawner (started by `zeroshard`)")
    p.add_argument("--world_info", default="", help="urlsafe-base64 JSON [[host, [slots]], ...]")
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--from_env", action="store_true",
                   help="one rank, its numbers from SLURM/Open MPI variables; exec the script")
    p.add_argument("--watch_stdin", action="store_true",
                   help="stdin is the launcher's channel: a signal name forwards it, EOF ends the node")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--enable_each_rank_log", default=None)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def rank_argv(args: argparse.Namespace, local_rank: int) -> list[str]:
    if args.no_python:
        cmd = [args.script]
    else:
        cmd = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.script]
    if not args.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.script_args)


def core_sets(num_local: int) -> list[list[int]]:
    """Split the cores we may run on evenly between this node's ranks (at least one each)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_local)
    return [[cores[(i * per + j) % len(cores)] for j in range(per)] for i in range(num_local)]


class NodeSupervisor:
    """Runs one node's ranks to the end; the first failure or stop request ends all of them."""

    def __init__(self, args: argparse.Namespace, resources: dict[str, list[int]]):
        self.args = args
        hosts = list(resources)
        if not 0 <= args.node_rank < len(hosts):
            raise SystemExit(f"zeroshard launch: --node_rank={args.node_rank} but the job has "
                             f"{len(hosts)} nodes")
        self.host = hosts[args.node_rank]
        self.slots = resources[self.host]
        self.first_rank = sum(len(resources[h]) for h in hosts[:args.node_rank])
        self.world_size = sum(len(s) for s in resources.values())
        self.num_nodes = len(hosts)
        self.events: queue.Queue = queue.Queue()
        self.procs: dict[int, object] = {}     # local rank -> Popen
        self.relays: list[threading.Thread] = []
        self.stop_signal: int | None = None
        self.kill_deadline: float | None = None
        self.failure: tuple[int, int] | None = None  # (local rank, returncode)

    def _say(self, text: str) -> None:
        procs.write_line(sys.stderr.buffer, text)

    def node_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(MASTER_ADDR=self.args.master_addr, MASTER_PORT=str(self.args.master_port),
                   WORLD_SIZE=str(self.world_size), LOCAL_SIZE=str(len(self.slots)),
                   CROSS_RANK=str(self.args.node_rank), CROSS_SIZE=str(self.num_nodes))
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        user_named = visible and not all(v.strip().isdigit() for v in visible.split(","))
        if local_gpu_ids(env) is not None and not user_named:
            # As DeepSpeed: the node's slots, so LOCAL_RANK i uses physical GPU slots[i].
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.slots))
        return env

    def start(self) -> None:
        import subprocess
        env = self.node_env()
        cores = core_sets(len(self.slots)) if self.args.bind_cores_to_rank else None
        log_dir = self.args.enable_each_rank_log
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        for local_rank in range(len(self.slots)):
            rank = self.first_rank + local_rank
            child_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local_rank))
            if cores:
                child_env["OMP_NUM_THREADS"] = str(len(cores[local_rank]))
            if log_dir:
                log = open(os.path.join(log_dir, f"rank_{rank}.log"), "ab")
                out = err = log
            else:
                out = err = subprocess.PIPE
            saved = os.sched_getaffinity(0) if cores else None
            if cores:  # affinity is per thread and inherited by fork: the child starts bound
                os.sched_setaffinity(0, cores[local_rank])
            try:
                proc = subprocess.Popen(rank_argv(self.args, local_rank), env=child_env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True)
            except OSError as e:
                self._say(f"zeroshard: cannot start rank {rank} on {self.host}: {e}")
                self.failure = self.failure or (local_rank, 127)
                self.request_stop(signal.SIGTERM)
                break
            finally:
                if saved is not None:
                    os.sched_setaffinity(0, saved)
                if log_dir:
                    log.close()
            self.procs[local_rank] = proc
            if not log_dir:
                prefix = f"[rank {rank}] ".encode()
                broken = lambda: self.events.put(("stop", signal.SIGTERM))  # launcher is gone
                self.relays.append(procs.relay_lines(proc.stdout, sys.stdout.buffer, prefix,
                                                     on_broken=broken))
                self.relays.append(procs.relay_lines(proc.stderr, sys.stderr.buffer, prefix,
                                                     on_broken=broken))
            threading.Thread(target=self._wait, args=(local_rank, proc), daemon=True).start()

    def _wait(self, local_rank: int, proc) -> None:
        # One blocking wait per rank: the first failure is seen the moment it happens.
        self.events.put(("exit", local_rank, proc.wait()))

    def watch_stdin(self) -> None:
        def read() -> None:
            # Raw reads on fd 0: a thread parked in sys.stdin's buffered reader holds its lock, and
            # the interpreter aborts at exit when it cannot take that lock.
            pending = b""
            while True:
                try:
                    chunk = os.read(0, 1024)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    name = line.strip().decode(errors="replace")
                    if name in ("INT", "TERM", "HUP"):
                        self.events.put(("stop", getattr(signal, "SIG" + name)))
            self.events.put(("stop", signal.SIGTERM))  # EOF: the launcher or its connection is gone
        threading.Thread(target=read, daemon=True).start()

    def request_stop(self, sig: int) -> None:
        if self.stop_signal is not None:
            return
        self.stop_signal = sig
        self.kill_deadline = time.monotonic() + KILL_GRACE_S
        for proc in self.procs.values():
            if proc.poll() is None:
                procs.signal_tree(proc.pid, sig)

    def run(self) -> int:
        procs.become_subreaper()
        parent = os.getppid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self.events.put(("stop", s)))
        if self.args.watch_stdin:
            self.watch_stdin()
        self.start()
        running = set(self.procs)
        while running:
            try:
                event = self.events.get(timeout=PARENT_POLL_S)
            except queue.Empty:
                event = None
            if event and event[0] == "exit":
                _, local_rank, rc = event
                running.discard(local_rank)
                if rc != 0 and self.stop_signal is None:
                    self.failure = (local_rank, rc)
                    self._say(f"zeroshard: rank {self.first_rank + local_rank} failed with "
                              f"{procs.describe_exit(rc)} (host {self.host}, local rank {local_rank}); "
                              "ending all ranks")
                    self.request_stop(signal.SIGTERM)
            elif event and event[0] == "stop":
                self.request_stop(event[1])
            if os.getppid() != parent:  # our ssh session (or the launcher) died without a word
                self.request_stop(signal.SIGTERM)
            if self.kill_deadline is not None and time.monotonic() > self.kill_deadline:
                for local_rank in running:
                    procs.signal_tree(self.procs[local_rank].pid, signal.SIGKILL)
                self.kill_deadline = None
        self.reap_orphans()
        for t in self.relays:
            t.join(timeout=1.0)
        if self.failure is not None:
            return procs.exit_status(self.failure[1])
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0

    def reap_orphans(self) -> None:
        """Whatever our ranks started and left behind was re-parented to us (subreaper): end it."""
        me = os.getpid()
        for pid in procs.descendants([me]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.02)


def exec_from_env(args: argparse.Namespace) -> int:
    """One rank started by mpirun/srun: take its numbers from the scheduler and exec the script."""
    try:
        found = discover_env(os.environ)
    except DiscoveryError as e:
        print(f"zeroshard launch: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, **found)
    if "RANK" not in env or "WORLD_SIZE" not in env:
        print("zeroshard launch: --from_env found no RANK/WORLD_SIZE, Open MPI or SLURM variables",
              file=sys.stderr)
        return 2
    if "SLURM_NODEID" in env:
        env.setdefault("CROSS_RANK", env["SLURM_NODEID"])
        env.setdefault("CROSS_SIZE", env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    argv = rank_argv(args, local_rank)
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    if args.from_env:
        return exec_from_env(args)
    return NodeSupervisor(args, decode_world_info(args.world_info)).run()


if __name__ == "__main__":
    sys.exit(main())
