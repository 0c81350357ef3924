# Rank discovery under srun / mpirun (launcher/discovery.py).
import pytest

from zeroshard.launcher.discovery import DiscoveryError, discover_env, expand_nodelist


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("gpu-a,node[8-10],login", ["gpu-a", "node8", "node9", "node10", "login"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1],b[2-3]", ["a1", "b2", "b3"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[a-b]", "node[3-1]"])
def test_bad_nodelist(text):
    with pytest.raises(DiscoveryError, match="SLURM nodelist"):
        expand_nodelist(text)


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_NODELIST": "gpu[07-10]",
         "SLURM_STEP_NODELIST": "gpu[08-10],gpu12"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}

CASES = [
    (SLURM, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
             "MASTER_ADDR": "gpu08", "MASTER_PORT": "29500"}),
    ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
      "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"}),
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE="4(x2),3,1", SLURM_NODEID="3", MASTER_PORT="6000",
          MASTER_ADDR="head"),
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "1",
      "MASTER_ADDR": "head", "MASTER_PORT": "6000"}),
    (dict(OMPI, MASTER_ADDR="192.0.2.1"),
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
      "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}),
    (dict(SLURM, **OMPI, MASTER_ADDR="h"),  # mpirun inside an allocation: its numbers win
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
      "MASTER_ADDR": "h", "MASTER_PORT": "29500"}),
    (dict(SLURM, RANK="0", WORLD_SIZE="1"), {}),  # an existing RANK wins
    ({"PATH": "/bin"}, {}),
]


@pytest.mark.parametrize("env, expected", CASES)
def test_discover_env(env, expected):
    assert discover_env(env) == expected


def test_ompi_needs_master_addr():
    with pytest.raises(DiscoveryError, match="MASTER_ADDR is not"):
        discover_env(OMPI)
