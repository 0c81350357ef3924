# `zeroshard check` (launcher/check.py): the judgements and the table as pure functions, the check's
# own plumbing against stand-in agents and a stand-in ssh, one run on this machine alone, and runs
# across the network-namespace hosts (conftest.TestHosts): all passing, a host with another zeroshard
# installed, a host whose sshd refuses the key, a blocked rendezvous port.
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import types

import pytest

from conftest import PKG, launcher_cmd, run_launcher, wait_for
from zeroshard.launcher import check
from zeroshard.launcher import check_report as report
from zeroshard.launcher.backends import Job
from zeroshard.launcher.host_memory import host_bytes_by_ranks_per_node, nvme_paths

GIB = 1 << 30


# ---- pure functions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stderr, kind, said", [
    ("Host key verification failed.\r\n", "host key", "Host key verification failed."),
    ("root@192.168.251.2: Permission denied (publickey).\n", "auth", None),
    # The telling line is not the last: the whole stderr is read.
    ("Received disconnect from 10.0.0.2 port 22:2: Too many authentication failures\r\n"
     "Disconnected from 10.0.0.2 port 22\r\n", "auth", "Received disconnect from 10.0.0.2 port 22:2: "
                                                         "Too many authentication failures"),
    ("ssh: Could not resolve hostname worker-9: Name or service not known\n", "DNS", None),
    ("ssh: connect to host 192.168.251.2 port 2299: Connection refused\n", "refused", None),
    ("ssh: connect to host 10.0.0.1 port 22: Connection timed out\n", "timeout", None),
    ("ssh: connect to host 10.0.0.1 port 22: No route to host\n", "no route", None),
    ("kex_exchange_identification: Connection closed by remote host\n", "closed", None),
    ("something new\n", "error", "something new"),
])
def test_ssh_failures_are_classified(stderr, kind, said):
    got, why, line = report.classify_ssh_failure(stderr)
    assert got == kind and line == (said or stderr.strip())
    if kind == "error":
        assert why == "something new"   # nothing matched: ssh's last line, as is
    else:
        assert why and why != stderr.strip()


def probe(**kw):
    base = {"python": "3.11.7", "torch": "2.11.0", "cuda": "13.0", "zeroshard": "0.1.0", "gpus": 0,
            "zeroshard_path": "/site/zeroshard", "mem_available_bytes": 64 * GIB, "nvme": {}}
    return {**base, **kw}


def test_the_host_that_differs_is_named():
    cells, summary = report.version_cells({"w0": probe(), "w1": probe(zeroshard="0.0.9"), "w2": probe()})
    assert cells["w0"].ok and cells["w2"].ok and cells["w1"].ok is False
    assert cells["w1"].text == "FAIL zeroshard"
    assert cells["w1"].reason == "zeroshard 0.0.9 from /site/zeroshard, but 0.1.0 on w0, w2"
    assert summary == "python 3.11.7, torch 2.11.0, cuda 13.0, zeroshard 0.1.0"
    # Two hosts: rank 0's host is the reference; a missing torch is named with its import error.
    no_torch = {**probe(), "torch_error": "ModuleNotFoundError: torch"}
    cells, _ = report.version_cells({"w0": probe(), "w1": no_torch})
    assert cells["w0"].ok and cells["w1"].text == "FAIL torch,cuda"
    assert "torch cannot be imported (ModuleNotFoundError: torch)" in cells["w1"].reason


def test_devices_memory_and_table():
    assert report.device_cell(probe(), [0, 1]).text == "cpu x2"
    assert report.device_cell(probe(gpus=8), [0, 1, 2, 3]).text == "gpu 4/8"
    short = report.device_cell(probe(gpus=4), list(range(8)))
    assert short.ok is False and "slots 0,1,2,3,4,5,6,7 need 8 GPUs, torch sees 4" in short.reason
    # A GPU host whose torch sees no GPU is broken, unless CUDA_VISIBLE_DEVICES hides them on purpose.
    broken = report.device_cell(probe(gpu_device_node="/dev/nvidia0", cuda_visible_devices=None,
                                      cuda_error="RuntimeError: Found no NVIDIA driver"), [0, 1])
    assert broken.ok is False and broken.text == "FAIL no gpu"
    assert broken.reason.startswith("/dev/nvidia0 exists but torch sees no GPU (RuntimeError: Found no "
                                    "NVIDIA driver; CUDA_VISIBLE_DEVICES unset)")
    assert report.device_cell(probe(gpu_device_node="/dev/nvidia0", cuda_visible_devices=""), [0]).ok
    low = report.memory_cell(probe(mem_available_bytes=3 * GIB), 2, 4 * GIB)
    assert low.ok is False and low.text == "FAIL 4.0/3.0 GiB"
    assert low.reason == "the planned setup needs 4.0 GiB of host memory for 2 ranks, MemAvailable is 3.0 GiB"
    assert report.memory_cell(probe(), 2, GIB).text == "ok 1.0/64.0 GiB"
    unplanned = report.memory_cell(probe(), 2, None)
    assert unplanned.ok is None and unplanned.text == "not planned"
    broken = report.memory_cell(probe(), 2, None, "the planner failed (KeyError: 'x')")
    assert broken.ok is False and broken.text == "FAIL planner" and broken.reason.startswith("the planner failed")
    good = {c: report.passed("ok") for c in report.COLUMNS}
    cells = {"w0": {**good, "memory": unplanned}, "worker-1": {**good, "port": report.failed("", "why")}}
    text = report.render(["w0", "worker-1"], cells)
    assert text.splitlines()[0].split() == ["host", *report.COLUMNS]
    assert text.splitlines()[-1] == "worker-1: port: why"
    assert report.failures(["w0", "worker-1"], cells) == ["worker-1 (port)"]


def test_host_memory_is_the_planners(monkeypatch):
    """The need comes from zeroshard.planner.host_bytes_per_node, always over the selected world;
    without --num_params it is not planned."""
    skipped = host_bytes_by_ranks_per_node({}, None, [2, 2])
    assert skipped.need is None and not skipped.error
    assert skipped.note.startswith("memory: skipped (not planned): pass --num_params")
    calls = []

    def host_bytes_per_node(config, num_params, gpus_per_node, nodes):
        calls.append((gpus_per_node, nodes))
        return gpus_per_node * (num_params // (gpus_per_node * nodes) + len(config))
    monkeypatch.setitem(sys.modules, "zeroshard.planner",
                        types.SimpleNamespace(host_bytes_per_node=host_bytes_per_node))
    got = host_bytes_by_ranks_per_node({"k": 1}, 600.0, [4, 2])
    assert got.need == {4: 4 * 101, 2: 2 * 101} and got.note.startswith("memory: planned by zeroshard.planner")
    assert all(g * n == 6 for g, n in calls)   # a host of 4 in a world of 6: per rank
    # The user's config: its ValueError is the caller's to report. The planner's own bug: an
    # error of the check, named (not a silent skip).
    def rejects(*_):
        raise ValueError("zero_optimization.stage: got 4")

    def breaks(*_):
        raise KeyError("offload_param")
    for fn, error in ((rejects, ValueError), (breaks, None)):
        monkeypatch.setitem(sys.modules, "zeroshard.planner", types.SimpleNamespace(host_bytes_per_node=fn))
        if error:
            with pytest.raises(error):
                host_bytes_by_ranks_per_node({}, 1e6, [2])
        else:
            broken = host_bytes_by_ranks_per_node({}, 1e6, [2])
            assert broken.need is None and broken.error == (
                "the planner failed (KeyError: 'offload_param'), so the host memory could not be checked")
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                                  "offload_param": {"device": "NVMe", "nvme_path": "/nvme2"}}}
    assert nvme_paths(nvme) == {"zero_optimization.offload_optimizer.nvme_path": "/nvme",
                                "zero_optimization.offload_param.nvme_path": "/nvme2"}


# ---- the check's plumbing: stand-in agents and a stand-in ssh -------------------------------------------

def make_check(hosts, remote=True, **args):
    ns = argparse.Namespace(**{"timeout": 10.0, "master_addr": "", **args})
    job = Job(python=sys.executable, script="", script_args=[], cwd=os.getcwd(), exports={}, master_addr="",
              master_port=29500)
    return check.Check(ns, {h: [0, 1] for h in hosts}, {}, job, remote,
                       check.MemoryPlan(None, "memory: skipped (not planned)"))


@pytest.mark.parametrize("ssh_script, cell, reason", [
    (None, "FAIL start", "w1: ssh: could not start ssh: No such file or directory"),
    ('echo "Received disconnect from 10.0.0.2 port 22:2: Too many authentication failures" >&2\n'
     'echo "Disconnected from 10.0.0.2 port 22" >&2\nexit 255\n', "FAIL auth",
     "ssh said: Received disconnect from 10.0.0.2 port 22:2: Too many authentication failures; try: ssh"),
], ids=["no_ssh", "too_many_keys"])
def test_ssh_that_cannot_start_or_fails(tmp_path, monkeypatch, ssh_script, cell, reason):
    if ssh_script is not None:
        (tmp_path / "ssh").write_text("#!/bin/sh\n" + ssh_script)
        (tmp_path / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))  # this `ssh`, or none
    c = make_check(["w0", "w1"])
    try:
        c.probe("w1")
    finally:
        for agent in c.agents.values():
            agent.close()
    assert c.cells["w1"]["ssh"].text == cell
    assert reason in report.render(c.hosts, c.cells)


def test_an_agent_that_closes_its_output_and_stays(monkeypatch):
    monkeypatch.setattr(check, "EXIT_GRACE_S", 0.2)
    agent = check.Agent("w0", ["/bin/sh", "-c", "exec 1>&-; read line"], None, None, False)
    try:
        with pytest.raises(check.AgentGone, match="closed its output and did not exit in 0.2 s"):
            agent.receive("hello", 10)
    finally:
        agent.close()   # EOF on its stdin ends `read`
    assert agent.proc.poll() is not None


def test_a_collective_reaches_every_host_with_few_threads(monkeypatch):
    """call_all sends every request before it waits: an all-reduce over more hosts than threads."""
    monkeypatch.setattr(check, "MAX_PARALLEL_HOSTS", 2)
    hosts, lock, everyone = [f"w{i}" for i in range(5)], threading.Lock(), threading.Event()
    sent, waiting, peak = [], [0], [0]

    class StandIn:
        alive = True

        def send(self, req):
            sent.append(req["rank"])
            if len(sent) == len(hosts):
                everyone.set()

        def receive(self, op, timeout, deadline=None):
            with lock:
                waiting[0] += 1
                peak[0] = max(peak[0], waiting[0])
            joined = everyone.wait(timeout)
            with lock:
                waiting[0] -= 1
            if not joined:
                raise check.AgentGone(f"no answer in {timeout:g} s")
            return {"op": op, "ok": True}

        def last_error(self):
            return "no message"
    c = make_check(hosts)
    c.agents = {h: StandIn() for h in hosts}
    replies = c.call_all({h: {"op": "all_reduce", "rank": r} for r, h in enumerate(hosts)}, 5)
    assert replies == [{"op": "all_reduce", "ok": True}] * len(hosts) and peak[0] <= 2


def test_the_rendezvous_address_is_found_as_the_launcher_finds_it():
    c = make_check(["w0", "w1"])
    c.probes = {"w0": {"addrs": ["10.0.0.1", "10.1.0.1"]}}
    assert c.rendezvous_addr("w0") == "10.0.0.1"
    c.probes = {"w0": {"addrs": [], "addrs_error": "exited 0 ''"}}
    assert c.rendezvous_addr("w0") is None and c.cells["w0"]["port"].text == "FAIL addr"
    assert c.cells["w0"]["port"].reason == "could not find w0's address: `hostname -I` exited 0 ''; " \
                                           "pass --master_addr"
    assert make_check(["w0", "w1"], master_addr="10.9.9.9").rendezvous_addr("w0") == "10.9.9.9"
    assert make_check(["w0"], remote=False).rendezvous_addr("w0") == "127.0.0.1"


# ---- whole runs -------------------------------------------------------------------------------------

def cells_of(stdout):
    """{host: {check: cell text}} from the table at the top of the output."""
    lines = stdout.split("\n\n")[0].splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    head = lines[0].split()
    rows = {}
    for line in lines[1:]:
        values = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        rows[values[0]] = dict(zip(head[1:], values[1:]))
    return rows


def test_this_machine_alone(tmp_path):
    """No hostfile: this machine, without ssh, as the launcher runs it; NVMe paths and memory checked."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "missing")}}}))
    r = run_launcher(["check", "--config", "ds.json", "--num_params", "1e12"], cwd=tmp_path,
                     env={"CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    row = cells_of(r.stdout)["localhost"]
    assert row["ssh"] == "local" and row["versions"] == "ok" and row["port"] == "ok"
    assert row["backend"] == "gloo ok" and row["nvme"] == "FAIL" and row["memory"].startswith("FAIL")
    assert f'localhost: nvme: zero_optimization.offload_param.nvme_path "{tmp_path / "missing"}" ' \
           "does not exist" in r.stdout
    assert "localhost: memory: the planned setup needs " in r.stdout
    assert "memory: planned by zeroshard.planner for 1e+12 parameters over 1 rank" in r.stdout
    assert "zeroshard check: FAILED on 1 of 1 hosts: localhost (memory, nvme)" in r.stdout
    assert report.LEGEND in r.stdout  # "-" and "not planned" explained under the table


# ---- across hosts -----------------------------------------------------------------------------------

OTHER_VERSION = "0.0.9"
# name: (host index in TestHosts, sshd port). worker-2 is another "machine" with an older zeroshard
# installed at the same path; worker-3's sshd does not know the test's key.
HOSTS = {"worker-0": (0, 2222), "worker-1": (1, 2222), "worker-2": (1, 2223), "worker-3": (1, 2224)}


@pytest.fixture(scope="module")
def cluster(test_hosts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("check")
    init = tmp / "__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{OTHER_VERSION}"',
                           (PKG / "__init__.py").read_text()))
    test_hosts.add_sshd(1, 2223, bind_files={str(init): str(PKG / "__init__.py")})
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "other")], check=True,
                   capture_output=True, timeout=30)
    test_hosts.add_sshd(1, 2224, settings={"AuthorizedKeysFile": f"{tmp / 'other'}.pub"}, expect_login=False)
    test_hosts.write_ssh_config(tmp / "ssh_config", HOSTS)
    return test_hosts, tmp


def run_check(cluster, tmp_path, hosts, *flags):
    test_hosts, tmp = cluster
    (tmp_path / "hostfile").write_text("".join(f"{h} slots=2\n" for h in hosts))
    argv = ["ip", "netns", "exec", test_hosts.ns[0]] + launcher_cmd() + [
        "check", "-H", "hostfile", "--launcher_args", f"-F {tmp / 'ssh_config'}", "--timeout", "30", *flags]
    # As in test_multinode: GLOO_* reaches every host, and the veth has the same name everywhere.
    env = dict(os.environ, GLOO_SOCKET_IFNAME=test_hosts.ifname, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=80)
    assert wait_for(lambda: not test_hosts.job_pids(), 10), f"left behind: {test_hosts.job_pids()}"
    return r


ALL_OK = {"ssh": "ok", "versions": "ok", "devices": "cpu x2", "memory": "ok ", "nvme": "ok", "port": "ok",
          "backend": "gloo ok"}
NUM_PARAMS = ["--num_params", "1e6"]

# (id, hosts in the hostfile, blocked (host index, port) or None, extra flags,
# {host: {check: (cell, reason)}}): every cell not listed must be as in ALL_OK (a "-" where the check
# could not run; memory: starting with "ok ").
SCENARIOS = [
    ("all_pass", ["worker-0", "worker-1"], None, NUM_PARAMS, {}),
    ("other_zeroshard", ["worker-0", "worker-1", "worker-2"], None, NUM_PARAMS, {
        "worker-2": {"versions": ("FAIL zeroshard", f"worker-2: versions: zeroshard {OTHER_VERSION} from "
                                                    f"{PKG}, but 0.1.0 on worker-0, worker-1")}}),
    # Without --num_params the memory is not planned: a skip, neither a pass nor a failure. With
    # one host left, the all-reduce is not run (one process proves nothing across hosts).
    ("key_refused", ["worker-0", "worker-3"], None, [], {
        "worker-3": {"ssh": ("FAIL auth", "worker-3: ssh: permission denied: the host refused every key"),
                     **{c: ("-", "") for c in list(ALL_OK)[1:]}},
        "worker-0": {"memory": ("not planned", "memory: skipped (not planned): pass --num_params"),
                     "backend": ("-", "backend: skipped: only 1 host can take part (worker-3 could not)")}}),
    ("port_blocked", ["worker-0", "worker-1"], (1, 29500), [], {
        "worker-1": {"port": ("FAIL", "worker-1: port: cannot connect to 192.168.251.1:29500 (the "
                                      "rendezvous, on worker-0): timed out after 5 s"), "backend": ("-", ""),
                     "memory": ("not planned", "")},
        "worker-0": {"backend": ("-", ""), "memory": ("not planned", "")}}),
]


@pytest.mark.parametrize("hosts, blocked, flags, expected", [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_check_across_hosts(cluster, tmp_path, hosts, blocked, flags, expected):
    test_hosts, _ = cluster
    if blocked and shutil.which("nft") is None:
        pytest.skip("needs nft (Debian package nftables, in the Makefile's APT_PKGS)")
    (tmp_path / "nvme").mkdir()
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}}))
    flags = ["--config", "ds.json", *flags]
    if blocked:
        with test_hosts.port_blocked(blocked[0], test_hosts.addrs[0], blocked[1]):
            r = run_check(cluster, tmp_path, hosts, *flags)
    else:
        r = run_check(cluster, tmp_path, hosts, *flags)
    out = r.stdout + r.stderr
    print(out)  # shown by pytest -rP, and on failure
    rows = cells_of(r.stdout)
    assert list(rows) == hosts, out
    for host in hosts:
        for column, want in ALL_OK.items():
            cell, reason = expected.get(host, {}).get(column, (want, ""))
            got = rows[host][column]
            assert got == cell or (cell == "ok " and got.startswith(cell)), f"{host} {column}\n{out}"
            assert reason in out, out
    failing = [h for h, e in expected.items() if any(cell.startswith("FAIL") for cell, _ in e.values())]
    assert r.returncode == (1 if failing else 0), out
    summary = r.stdout.strip().splitlines()[-1]
    if failing:
        assert summary.startswith(f"zeroshard check: FAILED on {len(failing)} of {len(hosts)} hosts: "), out
        assert all(f"{h} (" in summary for h in failing), out
    else:
        assert summary == f"zeroshard check: all {len(hosts)} hosts passed", out
