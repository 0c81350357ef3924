"""torch's own c10d flight recorder is off on a Gloo run that zeroshard starts (it fragments the
C heap: zeroshard/comm.py), unless the user sized it under either of torch's names."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, pickle, socket
    import torch, torch.distributed as dist
    import zeroshard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    zeroshard.init_distributed(dist_backend="gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]
    print(len(entries), os.environ.get("TORCH_FR_BUFFER_SIZE"), flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("user_env, want", [
    ({}, "0 0"),                                        # unset: off
    ({"TORCH_FR_BUFFER_SIZE": "100"}, "2 100"),         # sized by the user: kept
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, "2 None"),  # torch's older name: kept too
])
def test_torch_flight_recorder_is_off_unless_the_user_sized_it(user_env, want):
    env = {k: v for k, v in os.environ.items() if k not in (
        "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**env, **user_env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == want, r.stdout + r.stderr
