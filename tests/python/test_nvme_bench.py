"""zeroshard.nvme_bench, the `zeroshard-nvme-bench` command (run as `python -m zeroshard.nvme_bench`):
a quick grid prints one table row per backend and setting and an `aio` block that parses as JSON
with the ds_config's keys, and leaves no file behind; a directory that cannot hold the test file
ends with status 2 and a message naming it. Kept small (a 64 MB file): CI is near its time limit."""
import json
import subprocess
import sys

import pytest

from zeroshard import nvme_bench

CLI = [sys.executable, "-m", "zeroshard.nvme_bench"]
AIO_KEYS = {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}


def table_rows(stdout):
    """{(backend, block size label, queue depth, threads): (read GB/s, write GB/s)}."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in nvme_bench.BACKENDS:
            rows[(cells[0], cells[1], int(cells[2]), int(cells[3]))] = (float(cells[4]), float(cells[5]))
    return rows


def test_quick_grid_prints_every_setting_and_a_pasteable_aio_block(tmp_path):
    out = subprocess.run(CLI + ["--path", str(tmp_path), "--size", "64MB", "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    backends = [b for b, why_not in nvme_bench.runnable_backends().items() if why_not is None]
    block_sizes, depths, threads = nvme_bench.QUICK_GRID
    expected = {(b, bs, qd, t) for b in backends for bs in block_sizes for qd in depths for t in threads}
    rows = table_rows(out.stdout)
    assert set(rows) == expected, out.stdout
    assert all(read > 0 and write > 0 for read, write in rows.values()), out.stdout

    marker = "aio block for the ds_config:"
    assert marker in out.stdout, out.stdout
    block = json.loads(out.stdout.split(marker, 1)[1])
    assert set(block) == {"aio"} and set(block["aio"]) == AIO_KEYS, block
    aio = block["aio"]
    chosen = (nvme_bench.format_bytes(aio["block_size"]), aio["queue_depth"], aio["intra_op_parallelism"])
    assert any(key[1:] == chosen for key in rows), f"{aio} is none of the measured settings"
    assert list(tmp_path.iterdir()) == [], "the test file was left behind"


@pytest.mark.parametrize("make_path, needle", [
    (lambda tmp: tmp / "no-such-dir", "no such directory"),
    (lambda tmp: (tmp / "a-file").write_text("x") and tmp / "a-file", "not a directory"),
])
def test_a_path_that_cannot_hold_the_file_exits_2_naming_it(tmp_path, capsys, make_path, needle):
    path = make_path(tmp_path)
    assert nvme_bench.main(["--path", str(path), "--size", "1MB", "--quick"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and needle in err, err


def test_sizes_parse_with_decimal_and_binary_units():
    assert [nvme_bench.parse_bytes(s) for s in ("4GB", "512MB", "1GiB", "256K", "1048576")] == \
        [4 * 10**9, 512 * 10**6, 1 << 30, 1 << 18, 1 << 20]
    with pytest.raises(ValueError, match="4XB"):
        nvme_bench.parse_bytes("4XB")
