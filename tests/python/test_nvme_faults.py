"""NVMe offload's bad input and faults, on real filesystems and real processes (issue 20): a swap
path that is missing, a file, or on tmpfs (no O_DIRECT) is refused at initialize naming the key,
the path and the fix; a disk too small (a loop-mounted 8 MiB ext4 image) is refused before
training with the bytes needed and available; an I/O error or a short read in the middle of a
step ends that rank with an error naming the file, offset and size, and the other rank within the
collective timeout; the same for the parameters' files (offload_param "nvme"), whose read fails in
a gather; a checkpoint whose save meets an I/O error leaves nothing half-written. A stale swap
directory of a dead run is named in a warning and left alone."""
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.nn as nn

from harness import run_distributed, run_tolerating_deaths
from models import global_batch, tiny_gpt

KEY = "zero_optimization.offload_optimizer.nvme_path"
ENGINE_TIMEOUT_S = 6.0
MARGIN_S = 10.0


def _config(path, stage=2, sub_group=1000, pipeline=True, buffer_count=4):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "sub_group_size": sub_group,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path),
                                                        "pipeline_read": pipeline,
                                                        "pipeline_write": pipeline,
                                                        "buffer_count": buffer_count}}}


def _param_config(path):
    """Parameters on NVMe (stage 3, none kept in host memory), the optimizer in host memory."""
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0}}}


def refused_worker(config, needles, model="gpt"):
    import zeroshard
    net = {"gpt": tiny_gpt, "mlp": _big_mlp, "wide": _wide_mlp}[model]()
    with pytest.raises(ValueError) as info:
        zeroshard.initialize(model=net, config=config)
    message = str(info.value)
    missing = [n for n in needles if n not in message]
    assert not missing, f"the message does not name {missing}: {message}"
    return message


def test_a_missing_path_is_refused_naming_the_key_and_path(tmp_path):
    path = tmp_path / "no-such-dir"
    run_distributed(refused_worker, 1, _config(path), (KEY, str(path), "does not exist"))


def test_a_file_as_path_is_refused(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    run_distributed(refused_worker, 1, _config(path), (KEY, str(path), "not a directory"))


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_tmpfs_is_refused_for_its_missing_o_direct(block):
    path = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:8]}"  # tmpfs on Debian
    os.makedirs(path)
    config, key = (_config(path), KEY) if block == "offload_optimizer" else \
        (_param_config(path), "zero_optimization.offload_param.nvme_path")
    try:
        run_distributed(refused_worker, 1, config, (key, path, "O_DIRECT", "tmpfs"))
        assert [d for d in os.listdir(path) if d.startswith("zeroshard-swap-")] == []
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _big_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512))  # ~1M parameters


def _wide_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 1024))  # ~4.2M parameters


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB ext4 filesystem on a loop device, mounted at tmp_path/disk."""
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["truncate", "-s", "8M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_found_at_start_with_the_bytes_needed(small_disk):
    # ~1M parameters: master and two Adam moments are ~12 MB, more than the 8 MiB disk holds.
    message = run_distributed(refused_worker, 1, _config(small_disk, stage=1, sub_group=100000),
                              (KEY, str(small_disk), "bytes"), "mlp")[0]
    assert "available" in message, message
    assert [d for d in os.listdir(small_disk) if d.startswith("zeroshard-swap-")] == [], \
        "the refused run left its swap directory behind"


def test_a_disk_too_small_for_the_parameters_is_found_at_start(small_disk):
    # ~4.2M fp32 parameters (~17 MB of chunks at world 1) on the 8 MiB disk.
    message = run_distributed(refused_worker, 1, _param_config(small_disk),
                              ("zero_optimization.offload_param.nvme_path", str(small_disk), "bytes",
                               "available"), "wide")[0]
    assert [d for d in os.listdir(small_disk) if d.startswith("zeroshard-swap-")] == [], message


# ----- faults in the middle of a run -----

def fault_worker(path, fault_rank, fault, stage):
    """Trains until an error; after the first step, rank `fault_rank`'s engine has its next NVMe
    request of one kind fail (the engine's fault injection). Stage "3-params": the parameters on
    NVMe (the optimizer in host memory), so the fault meets a gather's read or a step's write."""
    from zeroshard import _C
    import zeroshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Several sub-groups per rank and one staging buffer: every step reads and writes most of them.
    config = _param_config(path) if stage == "3-params" else _config(path, stage=stage, buffer_count=1)
    engine, *_ = zeroshard.initialize(model=tiny_gpt(), config=config)
    start = time.monotonic()
    try:
        for step in range(4):
            if step == 1 and rank == fault_rank:
                engine._core.inject_nvme_fault(fault, "param" if stage == "3-params" else "optimizer")
            batch = global_batch("gpt", step, 2 * world)[2 * rank:2 * rank + 2]
            start = time.monotonic()
            engine.backward(engine(batch))
            engine.step()
    except RuntimeError as e:
        return {"error": str(e), "comm_error": isinstance(e, _C.CommError), "elapsed": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("fault,words,stage", [
    ("eio:read:1", ("read", "Input/output error"), 2),
    ("eio:write:1", ("write", "Input/output error"), 2),
    ("short:read:1", ("read", "short"), 2),
    ("eio:read:1", ("read", "Input/output error", "param_group"), "3-params"),
])
def test_an_io_error_mid_step_names_file_offset_and_size_and_ends_every_rank(tmp_path, fault, words, stage):
    env = {"ZEROSHARD_TIMEOUT": str(ENGINE_TIMEOUT_S / 60), "OMP_NUM_THREADS": "1"}
    got, _ = run_tolerating_deaths(fault_worker, 2, tmp_path, 1, fault, stage, timeout=90, env=env)
    assert set(got) == {0, 1}, got
    failing = got[1][1]
    assert failing["error"] is not None, got
    msg = failing["error"]
    for needle in words + (".swp", "offset", "bytes"):
        assert needle in msg, (needle, msg)
    other = got[0][1]
    assert other["error"] is not None and other["comm_error"], got
    assert other["elapsed"] < ENGINE_TIMEOUT_S + MARGIN_S, other
    assert "rank 1" in other["error"], other


def truncate_worker(path):
    import zeroshard
    # Writes waited for in the step (no pipeline), so none lands after the truncation below.
    engine, *_ = zeroshard.initialize(model=tiny_gpt(), config=_config(path, stage=1, buffer_count=1,
                                                                        pipeline=False))
    batch = global_batch("gpt", 0, 2)
    engine.backward(engine(batch))
    engine.step()
    swap = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".swp")]
    assert swap, os.listdir(path)
    for f in swap:
        os.truncate(f, 0)  # someone else's cleanup got to the files mid-run
    engine.backward(engine(batch))
    with pytest.raises(RuntimeError) as info:
        engine.step()
    return str(info.value)


def test_a_file_truncated_mid_run_is_an_error_naming_it(tmp_path):
    # A read past the end is short; one of a hole that a later write left (the file grows again)
    # reads zeros, which the region's header check refuses: either way the file and offset are named.
    msg = run_distributed(truncate_worker, 1, str(tmp_path))[0]
    assert ".swp" in msg and "offset" in msg and ("short read" in msg or "truncated" in msg), msg


def removed_worker(path):
    """Removing the swap files of a live run does not lose its state: the engine holds them open."""
    import zeroshard
    engine, *_ = zeroshard.initialize(model=tiny_gpt(), config=_config(path, stage=1))
    ref, *_ = zeroshard.initialize(model=tiny_gpt(), config=dict(_config(path, stage=1), zero_optimization={"stage": 1}))
    for step in range(3):
        batch = global_batch("gpt", step, 2)
        for e in (engine, ref):
            e.backward(e(batch))
            e.step()
        if step == 0:
            for r, _, fs in os.walk(path):
                for f in fs:
                    if f.endswith(".swp"):
                        os.remove(os.path.join(r, f))
    for a, b in zip(engine.module.parameters(), ref.module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()


def test_swap_files_removed_mid_run_lose_nothing(tmp_path):
    run_distributed(removed_worker, 1, str(tmp_path))


def stale_worker(path):
    import logging

    import zeroshard
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(Keep())
    zeroshard.initialize(model=tiny_gpt(), config=_config(path, stage=1))
    return records


def test_a_stale_directory_of_a_dead_run_is_named_and_kept(tmp_path):
    # A run killed with -9 leaves its directory: make one the same way.
    code = ("import os, torch, zeroshard\n"
            "engine = zeroshard.initialize(model=torch.nn.Linear(64, 64), config=%r)\n"
            "print('ready', flush=True)\n"
            "os.kill(os.getpid(), 9)\n") % (_config(tmp_path, stage=1),)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ready" in out.stdout, out.stderr[-2000:]
    stale = [d for d in os.listdir(tmp_path) if d.startswith("zeroshard-swap-")]
    assert len(stale) == 1, os.listdir(tmp_path)
    records = run_distributed(stale_worker, 1, str(tmp_path))[0]
    assert any(stale[0] in r and "bytes" in r for r in records), records
    assert stale[0] in os.listdir(tmp_path)  # never deleted
