# Real multi-node: two hosts made of network namespaces (192.168.251.1 and .2 on a veth pair that
# exists only inside them), each with its own sshd on port 2222 and a key made for the test. The
# launcher runs inside the first namespace and reaches both hosts over ssh.
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import SCRIPTS, launcher_cmd, pid_alive, wait_for


def job(test_hosts, tmp_path, *script_args, env=None):
    """Launch train_ddp.py on 2 hosts x 2 ranks from a directory whose name needs quoting."""
    work = tmp_path / "multi node 'dir; touch pwned"
    (work / "out").mkdir(parents=True, exist_ok=True)
    (work / "hostfile").write_text("".join(f"{a} slots=2\n" for a in test_hosts.addrs))
    (work / ".zeroshard_env").write_text("ZS_FROM_ENV_FILE=from cwd\n")
    argv = ["ip", "netns", "exec", test_hosts.ns[0]] + launcher_cmd() + [
        "-H", "hostfile", "--ssh_port", str(test_hosts.port),
        "--launcher_args", " ".join(test_hosts.ssh_options()),
        str(SCRIPTS / "train_ddp.py"), "--steps", "3", "--out_dir", "out"] + list(script_args)
    # GLOO_* reaches every node; the veth has the same name in both namespaces.
    full_env = dict(os.environ, GLOO_SOCKET_IFNAME=test_hosts.ifname, **(env or {}))
    return work, subprocess.Popen(argv, cwd=work, env=full_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)


def records(work):
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (work / "out").glob("rank*.json")}


def finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_two_nodes_two_ranks_train(test_hosts, tmp_path):
    work, proc = job(test_hosts, tmp_path, "; touch pwned")
    out, err = finish(proc, 150)
    assert proc.returncode == 0, err
    got = records(work)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, rec in got.items():
        assert f"[rank {rank}] rank {rank}/4 trained 3 steps" in out
        assert rec["extra"] == ["; touch pwned"] and rec["cwd"] == str(work)
        assert rec["env"] == {"MASTER_ADDR": test_hosts.addrs[0], "MASTER_PORT": "29500",
                              "LOCAL_RANK": str(rank % 2), "LOCAL_SIZE": "2", "CROSS_RANK": str(rank // 2),
                              "CROSS_SIZE": "2", "GLOO_SOCKET_IFNAME": test_hosts.ifname,
                              "ZS_FROM_ENV_FILE": "from cwd"}
    assert not list(tmp_path.rglob("pwned"))
    assert wait_for(lambda: not test_hosts.job_pids(), 10), test_hosts.job_pids()


def test_killed_rank_ends_the_job_on_both_hosts(test_hosts, tmp_path):
    work, proc = job(test_hosts, tmp_path, "--hang")
    try:
        assert wait_for(lambda: len(records(work)) == 4 or proc.poll() is not None, 120, 0.2), \
            "ranks did not start"
        assert proc.poll() is None, proc.communicate()
        got = records(work)
        os.kill(got[3]["pid"], signal.SIGKILL)   # rank 3: local rank 1 on the second host
        killed_at = time.monotonic()
        out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137, err
    assert f"zeroshard: rank 3 on host {test_hosts.addrs[1]} failed with exit code 137 (killed by SIGKILL)" \
        in err
    assert time.monotonic() - killed_at < 20
    assert wait_for(lambda: not any(pid_alive(r["pid"]) for r in got.values()), 10)
    assert wait_for(lambda: not test_hosts.job_pids(), 10), \
        f"left behind in the namespaces: {test_hosts.job_pids()}"


def test_unreachable_host_is_reported_with_the_ssh_command(test_hosts, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "hostfile").write_text(f"{test_hosts.addrs[0]} slots=1\n{test_hosts.addrs[1]} slots=1\n")
    r = subprocess.run(["ip", "netns", "exec", test_hosts.ns[0]] + launcher_cmd() + [
        "-H", "hostfile", "--ssh_port", "2299", "--launcher_args", " ".join(test_hosts.ssh_options()),
        str(SCRIPTS / "ranks.py")], cwd=work, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    for addr in test_hosts.addrs:
        assert f'cannot reach host "{addr}" over ssh' in r.stderr
        assert f"try: ssh -o BatchMode=yes -o ConnectTimeout=5 -p 2299 -i {test_hosts.key}" in r.stderr
