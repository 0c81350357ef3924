# Hostfile parsing and --include/--exclude/--num_nodes/--num_gpus selection (launcher/hostfile.py).
import pytest

from zeroshard.launcher.hostfile import (HostfileError, parse_hostfile, parse_hostfile_text,
                                         parse_node_specs, select_resources)

# DeepSpeed's documented hostfile (docs/_tutorials/getting-started.md).
DS_HOSTFILE = "worker-1 slots=4\nworker-2 slots=4\n"


def test_ds_documented_hostfile():
    assert list(parse_hostfile_text(DS_HOSTFILE).items()) == [("worker-1", 4), ("worker-2", 4)]


def test_comments_blank_lines_and_order_kept():
    text = "# cluster A\n\nnode-b slots=2   # fast one\n  \nnode-a slots=8\n# end\n"
    assert list(parse_hostfile_text(text)) == ["node-b", "node-a"]  # file order is rank order


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\n\nworker-1 slot=4\n",
     'hosts line 3: "worker-1 slot=4": expected "<host> slots=<n>"'),
    ("worker-0\n", 'hosts line 1: "worker-0": expected "<host> slots=<n>"'),
    ("worker-0 slots=four\n", 'hosts line 1: "worker-0 slots=four": expected "<host> slots=<n>"'),
    ("worker-0 slots=2 extra\n", 'hosts line 1: "worker-0 slots=2 extra": expected "<host> slots=<n>"'),
    ("worker-0 slots=0\n", 'hosts line 1: "worker-0 slots=0": slots must be at least 1'),
    ("a slots=1\nb slots=1\na slots=2\n",
     'hosts line 3: "a slots=2": host "a" is already listed on line 1'),
    ("", 'hosts: no hosts'),
    ("# only a comment\n\n", 'hosts: no hosts'),
    ('a;touch${IFS}/tmp/pwned slots=1\n', 'hosts line 1: host name "a;touch${IFS}/tmp/pwned" may hold only'),
    ("-oProxyCommand=x slots=1\n", 'hosts line 1: host name "-oProxyCommand=x" may hold only'),
    ("'quoted' slots=1\n", "hosts line 1: host name \"'quoted'\" may hold only"),
])
def test_hostfile_errors_name_line_and_text(text, message):
    with pytest.raises(HostfileError) as e:
        parse_hostfile_text(text, "hosts")
    assert str(e.value).startswith(message)


def test_hostfile_error_names_the_file(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=4\nworker-1 slot=4\n")
    with pytest.raises(HostfileError, match=f'^{path} line 2: "worker-1 slot=4"'):
        parse_hostfile(str(path))


def test_node_specs():
    assert parse_node_specs("worker-0@worker-1:0,2", "--include") == {"worker-0": None, "worker-1": [0, 2]}
    assert parse_node_specs("a:1@a:0", "--include") == {"a": [0, 1]}
    for bad in ("a:", "@a", "a:x", "a:1,,2"):
        with pytest.raises(HostfileError, match="--include"):
            parse_node_specs(bad, "--include")


POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 4, "worker-3": 4}
ALL = [0, 1, 2, 3]

# (include, exclude, num_nodes, num_gpus) -> expected {host: slots}; DeepSpeed's documented examples
# first (getting-started.md: "--include=worker-2:0,1", "--exclude=worker-2:0@worker-3:0,1").
SELECTIONS = [
    (("worker-2:0,1", "", -1, -1), {"worker-2": [0, 1]}),
    (("", "worker-2:0@worker-3:0,1", -1, -1),
     {"worker-0": ALL, "worker-1": ALL, "worker-2": [1, 2, 3], "worker-3": [2, 3]}),
    (("worker-0@worker-1:0,2", "", -1, -1), {"worker-0": ALL, "worker-1": [0, 2]}),
    (("worker-3@worker-0", "", -1, -1), {"worker-0": ALL, "worker-3": ALL}),  # hostfile order wins
    (("", "worker-1", -1, -1), {"worker-0": ALL, "worker-2": ALL, "worker-3": ALL}),
    (("", "worker-1:0,1,2,3", -1, -1), {"worker-0": ALL, "worker-2": ALL, "worker-3": ALL}),
    (("", "", 2, -1), {"worker-0": ALL, "worker-1": ALL}),
    (("", "", -1, 1), {h: [0] for h in POOL}),
    (("", "", 1, 2), {"worker-0": [0, 1]}),
    (("", "", -1, 6), {h: list(range(6)) for h in POOL}),  # CPU hosts: N processes each, as DS
]


@pytest.mark.parametrize("flags, expected", SELECTIONS)
def test_selection(flags, expected):
    got = select_resources(POOL, *flags)
    assert got == expected and list(got) == list(expected)


@pytest.mark.parametrize("flags, message", [
    (("worker-0", "worker-1", -1, -1), "mutually exclusive"),
    (("worker-0", "", 1, -1), "cannot be combined"),
    (("", "worker-0", -1, 2), "cannot be combined"),
    (("worker-9", "", -1, -1), '--include: host "worker-9" is not in the hostfile'),
    (("worker-0:7", "", -1, -1), '--include: host "worker-0" has no slot 7'),
    (("", "worker-5:0", -1, -1), '--exclude: host "worker-5" is not in the hostfile'),
    (("", "worker-0@worker-1@worker-2@worker-3", -1, -1), "no slots left"),
    (("", "", 5, -1), "--num_nodes 5: only 4 hosts"),
])
def test_selection_errors(flags, message):
    with pytest.raises(HostfileError, match=message):
        select_resources(POOL, *flags)


def test_selection_on_gpu_ids():
    # No hostfile, CUDA_VISIBLE_DEVICES=2,3: the pool is localhost's visible GPU ids.
    assert select_resources({"localhost": [2, 3]}, include="localhost:3") == {"localhost": [3]}
