# `zeroshard check`: before a job spends a GPU, check every host it would use, in parallel: ssh,
# versions, devices, host memory, NVMe paths, the rendezvous port and a real all-reduce. One agent
# per host (check_agent.py, over ssh) does the work; this side decides and prints one table.
from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import backends, hosts
from .backends import Job
from .check_report import (COLUMNS, LEGEND, Cell, backend_of, classify_ssh_failure, device_cell, failed, failures,
                           memory_cell, not_run, nvme_cell, passed, render, version_cells)
from .envfile import EnvFileError, collect_exports
from .host_memory import MemoryPlan, host_bytes_by_ranks_per_node, nvme_paths
from .hostfile import HostfileError, select_resources

AGENT_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_agent.py")
DEFAULT_TIMEOUT_S = 60.0
PORT_CONNECT_TIMEOUT_S = 5.0
EXIT_GRACE_S = 5.0        # for an agent that closed its output to exit and its stderr to drain
# Threads talking to agents at once. Collectives do not depend on it: call_all sends every request
# before it waits on any reply.
MAX_PARALLEL_HOSTS = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard check",
        description="Check every host a job would use (ssh, versions, devices, memory, NVMe, rendezvous "
                    "port, backend all-reduce) and print one table; exit status 0 only when all pass.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hosts.add_host_arguments(p)  # the launcher's own flags: both read them the same way
    p.add_argument("--config", "--deepspeed_config", dest="config", default=None,
                   help="ds_config.json: NVMe paths to check, offload settings for the planned host memory")
    p.add_argument("--num_params", type=float, default=None,
                   help="the model's parameter count (e.g. 7e9): the planner's host memory for the "
                        "config is checked against each host's MemAvailable (absent: not planned)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds each host gets for each step (connect and probe, port, all-reduce)")
    return p


class AgentGone(Exception):
    """The agent's process ended or did not answer in time; the message says which and why."""


class Agent:
    """One host's agent process (ssh, or a local python) and its JSON-lines channel. Popen's OSError
    (no ssh, out of file descriptors) reaches the caller."""

    def __init__(self, host: str, argv: list[str], env: dict | None, cwd: str | None, remote: bool):
        self.host, self.remote = host, remote
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.stderr_reader = threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append),
                                              daemon=True)
        threading.Thread(target=self._read, args=(self.proc.stdout, self.replies.put), daemon=True).start()
        self.stderr_reader.start()
        self.alive = True

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def receive(self, op: str, timeout: float, deadline: float | None = None) -> dict:
        """The reply to `op`, by `deadline` (default: `timeout` seconds from now)."""
        deadline = time.monotonic() + timeout if deadline is None else deadline
        while True:
            try:
                line = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AgentGone(f"no answer in {timeout:g} s") from None
            if line is None:
                try:
                    self.proc.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    raise AgentGone(f"it closed its output and did not exit in {EXIT_GRACE_S:g} s") from None
                # Bounded: a process ssh left behind may hold its stderr open.
                self.stderr_reader.join(timeout=EXIT_GRACE_S)
                raise AgentGone(f"exit {self.proc.returncode}")
            try:
                reply = json.loads(line)
            except ValueError:
                continue  # something printed on stdout by the remote shell's profile
            if reply.get("op") == op:
                return reply

    def send(self, req: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise AgentGone("its connection closed") from None

    def request(self, req: dict, timeout: float) -> dict:
        self.send(req)
        return self.receive(req["op"], timeout)

    def stderr_text(self) -> str:
        return "".join(s for s in self.stderr if s)

    def last_error(self) -> str:
        lines = [s.strip() for s in self.stderr if s and s.strip()]
        return lines[-1] if lines else "no message"

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the agent exits, even in the middle of a collective
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def parallel(fn, items: list) -> list:
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(len(items), MAX_PARALLEL_HOSTS)) as pool:
        return list(pool.map(fn, items))


class Check:
    def __init__(self, args: argparse.Namespace, resources: dict[str, list[int]], config: dict, job: Job,
                 remote: bool, memory: MemoryPlan):
        self.args, self.resources, self.config, self.job, self.remote = args, resources, config, job, remote
        self.hosts = list(resources)
        self.cells: dict[str, dict[str, Cell]] = {h: {c: not_run() for c in COLUMNS} for h in self.hosts}
        self.probes: dict[str, dict] = {}
        self.agents: dict[str, Agent] = {}
        self.memory = memory
        self.notes: list[str] = [LEGEND, memory.note]

    def start_agent(self, host: str) -> Agent:
        with open(AGENT_SOURCE_PATH, encoding="utf-8") as f:
            argv = [self.job.python, "-u", "-c", f.read()]
        if not self.remote:  # one host: this machine, as the launcher runs it
            return Agent(host, argv, dict(os.environ, **self.job.exports), self.job.cwd, False)
        command = backends.remote_shell_command(self.job, argv)
        ssh = backends.ssh_base(self.job) + backends.SSH_CHECK_OPTIONS + [host, command]
        return Agent(host, ssh, None, None, True)

    def probe(self, host: str) -> None:
        """ssh in, start the agent, and take its report (versions, GPUs, memory, NVMe paths)."""
        cells, timeout = self.cells[host], self.args.timeout
        try_cmd = shlex.join(backends.ssh_check_argv(self.job, host))
        try:
            agent = self.agents[host] = self.start_agent(host)
        except OSError as e:  # no ssh (or python) to run, or out of processes or file descriptors
            program = "ssh" if self.remote else self.job.python
            why = f"could not start {program}: {e.strerror or e}"
            if self.remote:
                cells["ssh"] = failed("start", f"{why} (is OpenSSH's client on PATH? too many hosts for "
                                      f"`ulimit -n`?); try: {try_cmd}")
            else:
                cells["ssh"] = passed("local")
                cells["versions"] = failed("python", why)
            return
        try:
            agent.receive("hello", timeout)
        except AgentGone as e:
            agent.alive = False
            code = agent.proc.returncode
            if agent.remote and code == 255:  # ssh's own failure (a remote command's is its exit code)
                kind, why, said = classify_ssh_failure(agent.stderr_text())
                cells["ssh"] = failed(kind, f"{why}; ssh said: {said}; try: {try_cmd}")
            elif agent.remote and code is None:
                cells["ssh"] = failed("timeout", f"{e} (a slow sshd, or a login script waiting for input?); "
                                      f"try: {try_cmd}")
            else:
                cells["ssh"] = passed("ok" if agent.remote else "local")
                cells["versions"] = failed("python", f"could not start {self.job.python} in "
                                           f"{self.job.cwd} ({e}): {agent.last_error()}")
            return
        cells["ssh"] = passed("ok" if agent.remote else "local")
        try:
            self.probes[host] = agent.request({"op": "probe", "nvme": nvme_paths(self.config)}, timeout)
        except AgentGone as e:
            agent.alive = False
            cells["versions"] = failed("probe", f"the agent did not report ({e}; importing torch "
                                       f"takes long?): {agent.last_error()}")

    def judge_host(self) -> None:
        """Versions (across hosts), devices, memory and NVMe from the probes alone."""
        self.probes = {h: self.probes[h] for h in self.hosts if h in self.probes}  # rank order, not arrival
        versions, summary = version_cells(self.probes)
        self.notes.append(f"versions: {summary}")
        for host, probe in self.probes.items():
            cells, ranks = self.cells[host], len(self.resources[host])
            cells["versions"] = versions[host]
            cells["devices"] = device_cell(probe, self.resources[host])
            need = None if self.memory.need is None else self.memory.need[ranks]
            cells["memory"] = memory_cell(probe, ranks, need, self.memory.error)
            cells["nvme"] = nvme_cell(probe, nvme_paths(self.config))

    def live(self) -> list[str]:
        return [h for h in self.hosts if h in self.probes and self.agents[h].alive]

    def gone(self, host: str, e: AgentGone) -> dict:
        self.agents[host].alive = False
        return {"error": f"the agent ended ({e}); its last message: {self.agents[host].last_error()}"}

    def call(self, host: str, req: dict, timeout: float) -> dict:
        try:
            return self.agents[host].request(req, timeout)
        except AgentGone as e:
            return self.gone(host, e)

    def call_all(self, requests: dict[str, dict], timeout: float) -> list[dict]:
        """Each host's reply to its request, in order. Every request is sent before any reply is
        awaited: a collective needs all of its ranks at once, however few threads wait."""
        deadline, sent = time.monotonic() + timeout, {}
        for host, req in requests.items():
            try:
                self.agents[host].send(req)
                sent[host] = None
            except AgentGone as e:
                sent[host] = self.gone(host, e)

        def one(host):
            if sent[host] is not None:
                return sent[host]
            try:
                return self.agents[host].receive(requests[host]["op"], timeout, deadline)
            except AgentGone as e:
                return self.gone(host, e)
        return parallel(one, list(requests))

    def check_port(self, addr: str, port: int) -> bool:
        """A listener on the master host, a TCP connect to addr:port from every host, before the store."""
        master, hosts = self.hosts[0], self.live()
        token = secrets.token_hex(8)
        got = self.call(master, {"op": "listen", "port": port, "token": token}, self.args.timeout)
        if "error" in got:
            self.cells[master]["port"] = failed("listen", f"cannot listen on port {port} on the master host "
                                                f"({got['error']}; another job's rendezvous? pass "
                                                "--master_port)")
            return False
        timeout = min(PORT_CONNECT_TIMEOUT_S, self.args.timeout)
        req = {"op": "connect", "addr": addr, "port": port, "token": token, "timeout": timeout}
        replies = self.call_all({h: req for h in hosts}, timeout + 10)
        self.call(master, {"op": "unlisten"}, self.args.timeout)
        for host, got in zip(hosts, replies):
            self.cells[host]["port"] = passed("ok") if got.get("ok") else failed(
                "", f"cannot connect to {addr}:{port} (the rendezvous, on {master}): {got.get('error')}")
        return all(got.get("ok") for got in replies)

    def check_backend(self, addr: str, port: int) -> None:
        """One process per host through the real rendezvous: init the backend, all-reduce ones."""
        hosts = [h for h in self.live() if "torch_error" not in self.probes[h]]
        if self.hosts[0] not in hosts:  # rank 0 holds the store at master_addr: nobody else can
            self.notes.append(f"backend: not run: torch cannot be imported on the master host "
                              f"{self.hosts[0]}")
            return
        chosen = {h: backend_of(self.probes[h]) for h in hosts}
        if len(set(chosen.values())) > 1:
            for h in hosts:
                others = ", ".join(f"{b} on {o}" for o, b in chosen.items() if b != chosen[h])
                self.cells[h]["backend"] = failed(chosen[h], f"hosts disagree on the backend ({chosen[h]} "
                                                  f"here, {others}): GPU and CPU-only hosts mixed")
            return
        left_out = [h for h in self.hosts if h not in hosts]
        if left_out and len(hosts) < 2:  # an all-reduce of one process proves nothing across hosts
            # Not "reachable": a host whose torch failed to import was reached, yet cannot take part.
            self.notes.append(f"backend: skipped: only {len(hosts)} host{'s' if len(hosts) != 1 else ''} "
                              f"can take part ({', '.join(left_out)} could not)")
            return
        if left_out:
            self.notes.append(f"backend: the all-reduce ran over {len(hosts)} of {len(self.hosts)} hosts "
                              f"({', '.join(left_out)} could not take part)")
        timeout = self.args.timeout
        requests = {host: {"op": "all_reduce", "rank": rank, "world": len(hosts), "addr": addr, "port": port,
                           "backend": chosen[host], "timeout": timeout} for rank, host in enumerate(hosts)}
        for host, got in zip(hosts, self.call_all(requests, timeout + 15)):
            if got.get("ok"):
                self.cells[host]["backend"] = passed(f"{chosen[host]} ok")
            else:
                why = got.get("error") or f"the all-reduce of ones gave {got.get('value')}, not {len(hosts)}"
                self.cells[host]["backend"] = failed(chosen[host], f"{chosen[host]} all-reduce over "
                                                     f"{len(hosts)} hosts via {addr}:{port}: {why}"
                                                     + interface_hint(chosen[host], why))

    def run(self) -> int:
        try:
            parallel(self.probe, self.hosts)
            self.judge_host()
            master = self.hosts[0]
            if master not in self.live():
                self.notes.append(f"port, backend: not run: the master host {master} did not report")
                return self.finish()
            addr = self.rendezvous_addr(master)
            if addr is None:
                self.notes.append("port, backend: not run: no rendezvous address")
                return self.finish()
            port = self.job.master_port
            self.notes.append(f"rendezvous: {addr}:{port} ({master})")
            if self.check_port(addr, port):
                self.check_backend(addr, port)
            else:
                self.notes.append("backend: not run: the rendezvous port check failed")
            return self.finish()
        finally:
            parallel(lambda a: a.close(), list(self.agents.values()))

    def rendezvous_addr(self, master: str) -> str | None:
        """As the launcher picks it: --master_addr, 127.0.0.1 alone, else the first address of
        `hostname -I` on the master host, whose failure is an error (the launcher stops on it too)."""
        if self.args.master_addr or not self.remote:
            return self.args.master_addr or "127.0.0.1"
        probe = self.probes[master]
        if probe.get("addrs"):
            return probe["addrs"][0]
        self.cells[master]["port"] = failed("addr", f"could not find {master}'s address: `hostname -I` "
                                            f"{probe.get('addrs_error', 'gave nothing')}; pass --master_addr")
        return None

    def finish(self) -> int:
        print(render(self.hosts, self.cells))
        print()
        for note in self.notes:
            print(note)
        bad = failures(self.hosts, self.cells)
        if bad:
            print(f"zeroshard check: FAILED on {len(bad)} of {len(self.hosts)} hosts: {'; '.join(bad)}")
            return 1
        print(f"zeroshard check: all {len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''} passed")
        return 0


def interface_hint(backend: str, why: str) -> str:
    """The usual cause of a backend that passes the port check and still cannot connect: each rank
    announces the address its host name resolves to (often 127.0.1.1 or a wrong network)."""
    if "127.0" in why or "connectFullMesh" in why or "no answer" in why:
        var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        return (f" (a rank may announce an address the others cannot reach: set {var}=<interface> "
                "here, and it reaches every host)")
    return ""


def load_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise hosts.LaunchError(f"--config {path}: {e.strerror}") from None
    except ValueError as e:
        raise hosts.LaunchError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise hosts.LaunchError(f"--config {path}: expected a JSON object, got {type(config).__name__}")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(hosts.glue_launcher_args(sys.argv[1:] if argv is None else argv, parser))
    if args.num_params is not None and args.num_params < 1:
        parser.error(f"--num_params: got {args.num_params:g}, expected the model's parameter count "
                     "(e.g. 7e9)")
    if args.timeout <= 0:
        parser.error(f"--timeout: got {args.timeout:g}, expected seconds > 0")
    try:
        pool, _ = hosts.resource_pool(args)
        resources = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
        config = load_config(args.config)
        try:
            memory = host_bytes_by_ranks_per_node(config, args.num_params, [len(s) for s in resources.values()])
        except ValueError as e:
            raise hosts.LaunchError(f"--config {args.config or '(none)'}: {e}") from None
        remote = len(resources) > 1 or args.force_multi
        # The port the launcher would use: across nodes its default; alone, a free one (or the asked one).
        port = args.master_port if args.master_port is not None else hosts.rendezvous_port(None, not remote)
        cwd = os.getcwd()
        job = Job(python=sys.executable, script="", script_args=[], cwd=cwd,
                  exports=collect_exports(dict(os.environ), cwd), master_addr=args.master_addr,
                  master_port=port, launcher_args=shlex.split(args.launcher_args), ssh_port=args.ssh_port)
    except (hosts.LaunchError, HostfileError, EnvFileError, OSError) as e:
        print(f"zeroshard check: {e}", file=sys.stderr)
        return 2
    return Check(args, resources, config, job, remote, memory).run()


if __name__ == "__main__":
    sys.exit(main())
