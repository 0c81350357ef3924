# The exact command lines each backend builds (launcher/backends.py), and that quoting holds against
# hostile paths and arguments.
import shlex

import pytest

from zeroshard.launcher import backends
from zeroshard.launcher.backends import Job, SPAWNER_PATH

PY = "/opt/py/bin/python3"
RES = {"worker-0": [0, 1], "worker-1": [0, 2]}


def make_job(**kw):
    base = dict(python=PY, script="train.py", script_args=["--deepspeed_config", "ds.json"],
                cwd="/home/u/run", exports={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/home/u/run"},
                master_addr="192.0.2.10", master_port=29500)
    base.update(kw)
    return Job(**base)


def test_world_info_round_trip_keeps_order():
    blob = backends.encode_world_info({"b": [1], "a": [0, 3]})
    assert list(backends.decode_world_info(blob).items()) == [("b", [1]), ("a", [0, 3])]


def test_spawner_argv():
    job = make_job(module=True, no_local_rank=True, each_rank_log="logs", bind_cores_to_rank=True)
    assert backends.spawner_argv(job, "WI", 1) == [
        PY, "-u", SPAWNER_PATH, "--world_info=WI", "--node_rank=1", "--master_addr=192.0.2.10",
        "--master_port=29500", "--watch_stdin", "--module", "--no_local_rank", "--bind_cores_to_rank",
        "--enable_each_rank_log=logs", "--", "train.py", "--deepspeed_config", "ds.json"]


def test_ssh_commands():
    job = make_job(ssh_port=2222, launcher_args=["-i", "/k/id"])
    wi = backends.encode_world_info(RES)
    argv = backends.ssh_node_argv(job, wi, 1, "worker-1")
    assert argv[:7] == ["ssh", "-p", "2222", "-i", "/k/id", "-o", "BatchMode=yes"]
    assert argv[7] == "worker-1" and len(argv) == 9
    assert argv[8] == (
        "cd /home/u/run && exec env NCCL_DEBUG=INFO PYTHONPATH=/home/u/run "
        f"{PY} -u {SPAWNER_PATH} --world_info={wi} --node_rank=1 --master_addr=192.0.2.10 "
        "--master_port=29500 --watch_stdin -- train.py --deepspeed_config ds.json")
    assert backends.ssh_check_argv(job, "worker-1") == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", "2222", "-i", "/k/id", "worker-1", "true"]
    assert backends.ssh_hostname_argv(job, "worker-0")[-3:] == ["worker-0", "hostname", "-I"]


HOSTILE = ["; touch /tmp/pwned", "$(touch /tmp/pwned)", "`id`", "a'b\"c", "new\nline", "", "*", "--x=a b"]


def test_remote_command_quoting_round_trips():
    """What the remote shell parses is exactly the argv we meant, whatever the pieces hold."""
    job = make_job(cwd="/tmp/dir with 'quote; touch x", script="my script.py", script_args=HOSTILE,
                   exports={"PYTHONPATH": "/a b:$(id)", "NCCL_X": "v;w"}, master_addr="h")
    argv = backends.spawner_argv(job, "WI", 0)
    command = backends.remote_shell_command(job, argv)
    cd_part, _, rest = command.partition(" && ")
    assert shlex.split(cd_part) == ["cd", job.cwd]
    assert shlex.split(rest) == ["exec", "env", "PYTHONPATH=/a b:$(id)", "NCCL_X=v;w"] + argv


def test_pdsh():
    job = make_job(ssh_port=2200, launcher_args=["-R", "ssh"])
    argv, env = backends.pdsh_argv(job, RES)
    wi = backends.encode_world_info(RES)
    assert argv[:8] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh"]
    assert shlex.split(argv[8].partition(" && ")[2]) == [
        "exec", "env", "NCCL_DEBUG=INFO", "PYTHONPATH=/home/u/run", PY, "-u", SPAWNER_PATH,
        f"--world_info={wi}", "--node_rank=%n", "--master_addr=192.0.2.10", "--master_port=29500",
        "--", "train.py", "--deepspeed_config", "ds.json"]
    assert env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2200"}


def test_openmpi():
    job = make_job(launcher_args=["--bind-to", "none"])
    argv = backends.openmpi_argv(job, {"worker-0": [0, 1], "worker-1": [0, 1]}, "/tmp/hf")
    assert argv == [
        "mpirun", "-n", "4", "-hostfile", "/tmp/hf", "--mca", "btl", "^openib", "--tag-output",
        "-wdir", "/home/u/run", "--bind-to", "none", "-x", "NCCL_DEBUG=INFO",
        "-x", "PYTHONPATH=/home/u/run", "-x", "MASTER_ADDR=192.0.2.10", "-x", "MASTER_PORT=29500",
        PY, "-u", SPAWNER_PATH, "--from_env", "--", "train.py", "--deepspeed_config", "ds.json"]
    assert backends.openmpi_hostfile_text({"a": [0, 1], "b": [0]}) == "a slots=2\nb slots=1\n"


@pytest.mark.parametrize("master_addr, nodelist, expected_head", [
    ("", None, ["srun", "-n", "8", "--nodes=2", "--ntasks-per-node=4", "--label", "--chdir=/home/u/run"]),
    ("h0", ["h0", "h1"], ["srun", "-n", "8", "--nodes=2", "--ntasks-per-node=4", "--label",
                          "--chdir=/home/u/run", "--nodelist=h0,h1"]),
])
def test_slurm(master_addr, nodelist, expected_head):
    job = make_job(master_addr=master_addr, exports={"NCCL_A": "x,y"})
    argv = backends.slurm_argv(job, 2, 4, nodelist)
    env = ["env", "NCCL_A=x,y", "MASTER_PORT=29500"] + ([f"MASTER_ADDR={master_addr}"] if master_addr else [])
    assert argv == expected_head + env + [PY, "-u", SPAWNER_PATH, "--from_env", "--", "train.py",
                                          "--deepspeed_config", "ds.json"]
