# Fixtures for the launcher tests: import the launcher even where zeroshard/__init__ cannot load (the
# compiled extension is not built), run the `zeroshard` command with a timeout, and build two test
# hosts from network namespaces, each with its own sshd.
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PKG = REPO / "python" / "zeroshard"
RUNNER = PKG / "launcher" / "runner.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"

try:
    import zeroshard.launcher  # noqa: F401
except ImportError:
    # zeroshard/__init__ imports the compiled extension; the launcher is plain Python: load it alone.
    for name in [m for m in sys.modules if m == "zeroshard" or m.startswith("zeroshard.")]:
        del sys.modules[name]
    _stub = types.ModuleType("zeroshard")
    _stub.__path__ = [str(PKG)]
    sys.modules["zeroshard"] = _stub
    import zeroshard.launcher  # noqa: F401


def launcher_cmd() -> list[str]:
    """Run by path: it works whether or not `import zeroshard` does (see runner.py's header)."""
    return [sys.executable, str(RUNNER)]


def run_launcher(args: list[str], cwd: Path | str, env: dict | None = None, timeout: float = 120,
                 prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run((prefix or []) + launcher_cmd() + args, cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ---- two test hosts: network namespaces joined by a veth pair, an sshd in each --------------------

SUBNET = "192.168.251"  # only ever configured inside the namespaces made here


class TestHosts:
    def __init__(self, tmp: Path):
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"zs{tag}a", f"zs{tag}b"]
        self.addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.port = 2222
        self.ifname = "zs0"          # the same name in both namespaces: one GLOO_SOCKET_IFNAME fits all
        self.tmp = tmp
        self.key = tmp / "id_ed25519"
        self.sshd: list[subprocess.Popen] = []
        self.made_ns: list[str] = []

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    def setup(self) -> None:
        for ns in self.ns:
            self.ip("netns", "add", ns)
            self.made_ns.append(ns)
        va, vb = f"{self.ns[0]}v", f"{self.ns[1]}v"
        self.ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, veth, addr in zip(self.ns, (va, vb), self.addrs):
            self.ip("link", "set", veth, "netns", ns)
            self.ip("-n", ns, "link", "set", veth, "name", self.ifname)
            self.ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
            self.ip("-n", ns, "link", "set", self.ifname, "up")
            self.ip("-n", ns, "link", "set", "lo", "up")
        for path in (self.tmp / "host_key", self.key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                           check=True, capture_output=True, timeout=30)
        shutil.copy(f"{self.key}.pub", self.tmp / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for ns, addr in zip(self.ns, self.addrs):
            self._start_sshd(ns, addr, self.port)
        for ns, addr in zip(self.ns, self.addrs):
            self._wait_for_sshd(ns, addr, self.port)

    def _start_sshd(self, ns: str, addr: str, port: int, settings: dict | None = None,
                    prefix: list[str] | None = None) -> str:
        """An sshd in `ns` on addr:port; `settings` replace sshd_config keywords (sshd takes the first
        of each), `prefix` runs before sshd inside the namespace. Returns the name of its log."""
        name = f"sshd_{ns}_{port}"
        lines = {"Port": str(port), "ListenAddress": addr, "HostKey": str(self.tmp / "host_key"),
                 "AuthorizedKeysFile": str(self.tmp / "authorized_keys"), "PermitRootLogin": "yes",
                 "StrictModes": "no", "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
                 "UsePAM": "no", "UseDNS": "no", "PidFile": "none", "MaxStartups": "100",
                 "MaxSessions": "100", **(settings or {})}
        conf = self.tmp / f"{name}.conf"
        conf.write_text("".join(f"{k} {v}\n" for k, v in lines.items()))
        log = open(self.tmp / f"{name}.log", "w")
        self.sshd.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, *(prefix or []), "/usr/sbin/sshd", "-D", "-e", "-f", str(conf)],
            stdout=log, stderr=log))
        return name

    def _wait_for_sshd(self, ns: str, addr: str, port: int, expect_login: bool = True) -> None:
        def answers() -> bool:
            if not expect_login:  # a daemon that refuses us: its port answering is enough
                return subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn", f"sport = :{port}"],
                                      capture_output=True, text=True, timeout=10).stdout.strip() != ""
            return subprocess.run(self.ssh_argv(addr, "true", port=port), capture_output=True, timeout=20,
                                  stdin=subprocess.DEVNULL).returncode == 0
        if not wait_for(lambda: not self.sshd_alive() or answers(), 10, 0.2) or not self.sshd_alive():
            raise RuntimeError(f"sshd in {ns} on port {port} did not come up: "
                               + (self.tmp / f"sshd_{ns}_{port}.log").read_text())

    def add_sshd(self, host_index: int, port: int, settings: dict | None = None,
                 bind_files: dict[str, str] | None = None, expect_login: bool = True) -> None:
        """Another "host" in the namespace of host `host_index`: its own sshd on `port`, with sshd_config
        `settings`, and files `bind_files` {replacement: path} mounted over paths in its own mount
        namespace (another version of a package installed at the same path, as on another machine)."""
        ns, addr = self.ns[host_index], self.addrs[host_index]
        prefix = []
        if bind_files:
            mounts = " && ".join(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}"
                                 for src, dst in bind_files.items())
            prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"',
                      "sh"]
        self._start_sshd(ns, addr, port, settings, prefix)
        self._wait_for_sshd(ns, addr, port, expect_login)

    def write_ssh_config(self, path: Path, hosts: dict[str, tuple[int, int]]) -> None:
        """An ssh_config naming hosts {name: (host index, sshd port)}, with the test's key and options."""
        blocks = [f"Host {name}\n  HostName {self.addrs[i]}\n  Port {port}\n"
                  for name, (i, port) in hosts.items()]
        path.write_text("".join(blocks) + f"Host *\n  IdentityFile {self.key}\n  StrictHostKeyChecking no\n"
                        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")

    @contextlib.contextmanager
    def port_blocked(self, host_index: int, daddr: str, port: int):
        """An nftables rule in host `host_index`'s namespace that drops its TCP packets to daddr:port."""
        nft = ["ip", "netns", "exec", self.ns[host_index], "nft"]
        table = f"zscheck{port}"
        subprocess.run(nft + ["add", "table", "inet", table], check=True, capture_output=True, timeout=10)
        try:
            subprocess.run(nft + ["add", "chain", "inet", table, "out",
                                  "{ type filter hook output priority 0 ; }"],
                           check=True, capture_output=True, timeout=10)
            subprocess.run(nft + ["add", "rule", "inet", table, "out", "ip", "daddr", daddr, "tcp", "dport",
                                  str(port), "drop"], check=True, capture_output=True, timeout=10)
            yield
        finally:
            subprocess.run(nft + ["delete", "table", "inet", table], capture_output=True, timeout=10)

    def sshd_alive(self) -> bool:
        return all(p.poll() is None for p in self.sshd)

    def ssh_options(self) -> list[str]:
        return ["-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]

    def ssh_argv(self, addr: str, *cmd: str, port: int | None = None) -> list[str]:
        return ["ip", "netns", "exec", self.ns[0], "ssh", "-o", "BatchMode=yes", "-p", str(port or self.port),
                *self.ssh_options(), addr, *cmd]

    def job_pids(self) -> set[int]:
        """Processes in the two namespaces other than the sshd daemons themselves."""
        daemons = {p.pid for p in self.sshd}  # `ip netns exec` execs sshd: the same pid
        pids: set[int] = set()
        for ns in self.made_ns:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
            pids |= {int(x) for x in out.stdout.split()}
        return pids - daemons

    def teardown(self) -> None:
        for p in self.sshd:
            if p.poll() is None:
                p.terminate()
        for p in self.sshd:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        for ns in self.made_ns:  # anything still in our namespaces is ours (a failed test's leftovers)
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
            for pid in map(int, out.stdout.split()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _netns_unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd is not installed (Debian package openssh-server)"
    probe = f"zsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="module")
def test_hosts(tmp_path_factory):
    reason = _netns_unusable()
    if reason:
        pytest.skip(f"multi-node launcher tests: {reason}")
    hosts = TestHosts(tmp_path_factory.mktemp("hosts"))
    try:
        hosts.setup()
        yield hosts
    finally:
        hosts.teardown()
