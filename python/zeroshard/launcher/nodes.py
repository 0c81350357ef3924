# The launcher's side of a running job: one process per node (a local spawner, an ssh connection, or
# a single pdsh / mpirun / srun), their stderr scanned for the spawners' failure reports, and the
# rule that the first failure or signal ends every node.
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from . import procs
from .launch import KILL_GRACE_S

# Written by launch.NodeSupervisor; pdsh / mpirun may put a "host: " tag in front.
FAILURE_RE = re.compile(r"zeroshard: rank (\d+) failed with exit code (\d+)(?: \(([^)]*)\))? "
                        r"\(host (\S+), local rank (\d+)\)")
STOP_GRACE_S = KILL_GRACE_S + 5.0  # the spawners' own grace, plus time for ssh to wind down


@dataclass
class NodeProcess:
    label: str                 # "node 1 (worker-1)", "pdsh", ...
    argv: list[str]
    env: dict[str, str]
    control_stdin: bool        # True: a spawner reads signal names / EOF from our pipe


@dataclass
class Failure:
    rank: int | None
    host: str | None
    exit_code: int
    detail: str

    def describe(self) -> str:
        if self.rank is None:
            return self.detail
        extra = f" ({self.detail})" if self.detail else ""
        return f"rank {self.rank} on host {self.host} failed with exit code {self.exit_code}{extra}"


class NodeGroup:
    def __init__(self, nodes: list[NodeProcess]):
        self.nodes = nodes
        self.procs: list[subprocess.Popen] = []
        self.events: queue.Queue = queue.Queue()
        self.stopping = False
        self.deadline: float | None = None
        self.relays: list[threading.Thread] = []

    def start(self) -> None:
        for i, node in enumerate(self.nodes):
            proc = subprocess.Popen(node.argv, env=node.env,
                                    stdin=subprocess.PIPE if node.control_stdin else subprocess.DEVNULL,
                                    stdout=None, stderr=subprocess.PIPE,
                                    start_new_session=True)  # Ctrl-C reaches us; we pass it on
            self.procs.append(proc)
            self.relays.append(procs.relay_lines(proc.stderr, sys.stderr.buffer, b"",
                              on_line=lambda line: self._scan(line)))
            threading.Thread(target=lambda i=i, p=proc: self.events.put(("exit", i, p.wait())),
                             daemon=True).start()

    def _scan(self, line: bytes) -> None:
        m = FAILURE_RE.search(line.decode(errors="replace"))
        if m:
            self.events.put(("failure", Failure(int(m.group(1)), m.group(4), int(m.group(2)),
                                                m.group(3) or "")))

    def stop(self, sig: int) -> None:
        """Tell every node still running to end its ranks with `sig`; SIGKILL after STOP_GRACE_S."""
        if self.stopping:
            return
        self.stopping = True
        self.deadline = time.monotonic() + STOP_GRACE_S
        for node, proc in zip(self.nodes, self.procs):
            if proc.poll() is not None:
                continue
            if node.control_stdin:
                try:
                    proc.stdin.write(signal.Signals(sig).name[3:].encode() + b"\n")
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            else:
                procs.signal_tree(proc.pid, sig)

    def run(self) -> tuple[int, Failure | None, int | None]:
        """Returns (exit status, first failure or None, signal that stopped us or None)."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self.events.put(("signal", s)))
        self.start()
        running = set(range(len(self.procs)))
        failure: Failure | None = None        # the first spawner report to arrive is the cause
        bad_exit: tuple[int, int] | None = None
        stopped_by: int | None = None
        while running or not self.events.empty():
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            if event and event[0] == "failure":
                if failure is None and stopped_by is None:
                    failure = event[1]
                self.stop(signal.SIGTERM)
            elif event and event[0] == "exit":
                running.discard(event[1])
                if event[2] != 0 and bad_exit is None and stopped_by is None:
                    bad_exit = (event[1], event[2])
                    self.stop(signal.SIGTERM)
            elif event and event[0] == "signal":
                if failure is None and bad_exit is None and stopped_by is None:
                    stopped_by = event[1]
                self.stop(event[1])
            if self.deadline is not None and time.monotonic() > self.deadline:
                for i in running:
                    procs.signal_tree(self.procs[i].pid, signal.SIGKILL)
                self.deadline = None
            if not running:
                for t in self.relays:  # a spawner's report precedes its exit, but its pipe may lag
                    t.join(timeout=2.0)
                running_relays = [t for t in self.relays if t.is_alive()]
                self.relays = running_relays
        if failure is not None:
            return failure.exit_code, failure, None
        if bad_exit is not None:
            i, rc = bad_exit
            return procs.exit_status(rc), Failure(None, None, procs.exit_status(rc),
                f"{self.nodes[i].label} exited with {procs.describe_exit(rc)}"), None
        if stopped_by is not None:
            return 128 + stopped_by, None, stopped_by
        return 0, None, None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def run_nodes(nodes: list[NodeProcess], pid_file: str | None = None) -> int:
    group = NodeGroup(nodes)
    code, failure, stopped_by = group.run() if pid_file is None else _run_with_pid_file(group, pid_file)
    if failure is not None:
        procs.write_line(sys.stderr.buffer, f"zeroshard: {failure.describe()}; all ranks ended; "
                                            f"exiting with {code}")
    elif stopped_by is not None:
        procs.write_line(sys.stderr.buffer, f"zeroshard: stopped by {signal.Signals(stopped_by).name}; "
                                            f"ended all ranks; exiting with {code}")
    return code


def _run_with_pid_file(group: NodeGroup, pid_file: str):
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()}\n")
    try:
        return group.run()
    finally:
        try:
            os.unlink(pid_file)
        except OSError:
            pass
