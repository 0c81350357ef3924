# What `zeroshard` decides before anything runs (launcher/runner.py): hosts, node processes, master
# address, reachability errors. ssh / mpirun / srun are fakes on PATH that log their argv.
import json
import os
import sys

import pytest

from zeroshard.launcher import backends, hosts, runner
from zeroshard.launcher.launch import NodeSupervisor, parse_args as spawner_args

FAKE = r'''#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps([name] + sys.argv[1:]) + "\n")
if name == "ssh":
    host = [a for a in sys.argv[1:] if not a.startswith("-")]
    down = os.environ.get("FAKE_DOWN", "").split(",")
    args = sys.argv[1:]
    if args[-1] == "true" and args[-2] in down:
        sys.stderr.write(f"ssh: connect to host {{args[-2]}} port 22: Connection refused\n")
        sys.exit(255)
    if args[-2:] == ["hostname", "-I"]:
        print("192.0.2.7 fe80::1")
'''


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ssh", "mpirun", "srun"):
        path = bin_dir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hosts, "DEFAULT_HOSTFILE", str(tmp_path / "no-such-hostfile"))  # read by resource_pool
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path))

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return work, calls


def plan(*argv):
    parser = runner.build_parser()
    return runner.plan(parser.parse_args(runner.glue_launcher_args(list(argv), parser)))


def spawner_of(node):
    """The spawner argv inside a node process (local, or the remote command of an ssh)."""
    argv = node.argv if node.argv[0] != "ssh" else \
        __import__("shlex").split(node.argv[-1].partition(" && ")[2])
    return spawner_args(argv[argv.index(backends.SPAWNER_PATH) + 1:])


def test_two_hosts_over_ssh(fakes):
    work, calls = fakes
    (work / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    nodes, _ = plan("-H", "hostfile", "--ssh_port", "2222", "--launcher_args", "-i /k/id",
                    "train.py", "--lr", "1")
    assert [n.label for n in nodes] == ["node 0 (worker-0)", "node 1 (worker-1)"]
    for i, node in enumerate(nodes):
        assert node.control_stdin and node.argv[:5] == ["ssh", "-p", "2222", "-i", "/k/id"]
        a = spawner_of(node)
        assert (a.node_rank, a.master_addr, a.script, a.script_args) == (i, "192.0.2.7", "train.py",
                                                                          ["--lr", "1"])
        assert backends.decode_world_info(a.world_info) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    check = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", "2222", "-i", "/k/id"]
    assert sorted(calls()) == sorted([check + ["worker-0", "true"], check + ["worker-1", "true"],
                                      check + ["worker-0", "hostname", "-I"]])


def test_unreachable_host_names_host_and_command(fakes, monkeypatch):
    work, _ = fakes
    (work / "hostfile").write_text("worker-0 slots=1\nworker-1 slots=1\n")
    monkeypatch.setenv("FAKE_DOWN", "worker-1")
    with pytest.raises(runner.LaunchError) as e:
        plan("-H", "hostfile", "train.py")
    assert 'cannot reach host "worker-1" over ssh (ssh: connect to host worker-1 port 22: Connection ' \
           'refused); try: ssh -o BatchMode=yes -o ConnectTimeout=5 worker-1 true' in str(e.value)
    assert "worker-0" not in str(e.value)


def test_single_host_runs_locally_without_ssh(fakes):
    work, calls = fakes
    (work / "hostfile").write_text("worker-7 slots=3\n")
    nodes, _ = plan("-H", "hostfile", "--master_port", "4000", "train.py")
    (node,) = nodes
    a = spawner_of(node)
    assert node.argv[0] == sys.executable and node.control_stdin
    assert (a.node_rank, a.master_addr, a.master_port) == (0, "127.0.0.1", 4000)
    assert node.env["PYTHONPATH"].split(os.pathsep)[0] == str(work)
    assert calls() == []


def test_force_multi_uses_ssh_for_one_host(fakes):
    work, _ = fakes
    (work / "hostfile").write_text("worker-7 slots=1\n")
    nodes, _ = plan("-H", "hostfile", "--force_multi", "--no_ssh_check", "--master_addr", "m", "t.py")
    assert nodes[0].argv[0] == "ssh" and nodes[0].argv[-2] == "worker-7"


def test_no_hostfile_means_this_machine(fakes, capsys):
    nodes, _ = plan("--num_gpus", "3", "train.py")
    a = spawner_of(nodes[0])
    assert backends.decode_world_info(a.world_info) == {"localhost": [0, 1, 2]}
    assert "no hostfile" in capsys.readouterr().err


def test_visible_gpus_become_slots(fakes, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    nodes, _ = plan("train.py")
    assert backends.decode_world_info(spawner_of(nodes[0]).world_info) == {"localhost": [2, 3]}


def test_no_ssh_runs_one_node(fakes):
    work, calls = fakes
    (work / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    nodes, _ = plan("-H", "hostfile", "--no_ssh", "--node_rank", "1", "train.py")
    a = spawner_of(nodes[0])
    assert (a.node_rank, a.master_addr) == (1, "worker-0") and calls() == []


@pytest.mark.parametrize("argv, message", [
    (["-H", "missing-file", "t.py"], "hostfile missing-file not found"),
    (["--no_ssh", "t.py"], "--no_ssh needs --node_rank"),
    (["--node_rank", "1", "t.py"], "--node_rank is only used with --no_ssh"),
    (["--launcher", "pdsh", "--force_multi", "--no_ssh_check", "--master_addr", "m", "t.py"],
     "needs `pdsh` on PATH"),
])
def test_usage_errors(fakes, argv, message):
    with pytest.raises(runner.LaunchError, match=message):
        plan(*argv)


def test_openmpi_and_slurm(fakes):
    work, _ = fakes
    (work / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    nodes, temp = plan("-H", "hostfile", "--launcher", "openmpi", "--no_ssh_check", "t.py")
    assert nodes[0].argv[:5] == ["mpirun", "-n", "4", "-hostfile", temp[0]]
    assert "MASTER_ADDR=192.0.2.7" in nodes[0].argv
    assert open(temp[0]).read() == "worker-0 slots=2\nworker-1 slots=2\n"
    os.unlink(temp[0])
    with pytest.raises(runner.LaunchError, match="slot lists"):
        plan("-H", "hostfile", "--launcher", "openmpi", "-e", "worker-1:0", "--no_ssh_check", "t.py")
    (work / "hostfile").unlink()
    nodes, _ = plan("--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "4", "t.py")
    assert nodes[0].argv[:5] == ["srun", "-n", "8", "--nodes=2", "--ntasks-per-node=4"]


def test_launcher_args_may_start_with_a_dash():
    parser = runner.build_parser()
    glued = runner.glue_launcher_args(
        ["-H", "hf", "--launcher_args", "-i k -p 2", "s.py", "--launcher_args", "-x"], parser)
    assert glued == ["-H", "hf", "--launcher_args=-i k -p 2", "s.py", "--launcher_args", "-x"]
    args = parser.parse_args(glued)
    assert args.launcher_args == "-i k -p 2" and args.user_args == ["--launcher_args", "-x"]


@pytest.mark.parametrize("cuda_visible, expected", [(None, None), ("4,5,6", "4,6")])
def test_spawner_sets_cuda_visible_devices_only_with_gpus(monkeypatch, cuda_visible, expected):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    if cuda_visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible)
    wi = backends.encode_world_info({"a": [0], "b": [4, 6]})
    sup = NodeSupervisor(spawner_args([f"--world_info={wi}", "--node_rank=1", "t.py"]),
                         backends.decode_world_info(wi))
    env = sup.node_env()
    assert env.get("CUDA_VISIBLE_DEVICES") == expected
    assert (env["WORLD_SIZE"], env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("3", "2", "1", "2")
    assert sup.first_rank == 1
