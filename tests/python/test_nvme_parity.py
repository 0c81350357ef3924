"""The numerics contract with state on NVMe (issue 20): offload_optimizer.device "nvme" at stages
1, 2 and 3, and offload_param.device "nvme" at stage 3 (with the optimizer on NVMe, in host memory
or on the device), give the same update as the single-process torch.optim reference, at
test_zero_parity.py's tolerances, with the state really on disk: after the steps no master or
optimizer state is held in host or device memory, the parameter chunks in host memory fit
offload_param.max_in_cpu (as accounted, and as the kernel reports the store's pages), the swap
files exist while the run lives, host buffers stay within buffer_count staging buffers, and the
directories are gone after a clean exit. The swap directory is a real directory on the machine's
disk (ext4, O_DIRECT)."""
import os

import pytest
import torch

from harness import run_distributed
from test_offload_parity import BUCKET, parity_engine


def _zero_block(stage, path, sub_group=1000, buffer_count=4, pipeline=True, param=None, optimizer="nvme",
                max_in_cpu=None, param_buffers=None):
    """Sub-groups of about 1000 elements, so each rank's state is many regions of its files;
    `param`: where the parameter chunks live (offload_param.device "cpu" or "nvme", with
    `max_in_cpu` and `param_buffers` staging buffers); `optimizer`: offload_optimizer.device."""
    block = {"stage": stage, "reduce_bucket_size": BUCKET, "sub_group_size": sub_group}
    if optimizer != "none":
        block["offload_optimizer"] = {"device": optimizer}
    if optimizer == "nvme":
        block["offload_optimizer"].update({"nvme_path": path, "buffer_count": buffer_count,
                                           "pipeline_read": pipeline, "pipeline_write": pipeline})
    if param:
        block["offload_param"] = {"device": param}
    if param == "nvme":
        block["offload_param"].update({"nvme_path": path, "max_in_cpu": max_in_cpu})
        # Smaller than the model: the reads ahead run beyond what the gathers prefetch.
        block["stage3_prefetch_bucket_size"] = 20000
        if param_buffers is not None:
            block["offload_param"]["buffer_count"] = param_buffers
    if stage == 3:
        block["stage3_param_persistence_threshold"] = 0
    return block


def _swap_dirs(path):
    return [d for d in os.listdir(path) if d.startswith("zeroshard-swap-")]


def nvme_parity_worker(stage, precision, gas, path, opts):
    """test_zero_parity's worker on an NVMe config, then where the state is."""
    block = _zero_block(stage, path, **{k: v for k, v in opts.items() if k != "model"})
    engine = parity_engine(opts.get("model", "gpt"), stage, precision, gas, block)
    got = engine.memory_bytes()
    rank = int(os.environ["RANK"])
    mine = [d for d in _swap_dirs(path) if d.endswith(f"-rank{rank}")]
    # One directory per rank and offload block on NVMe.
    assert len(mine) == (opts.get("optimizer", "nvme") == "nvme") + (opts.get("param") == "nvme"), _swap_dirs(path)
    for d in mine:
        files = os.listdir(os.path.join(path, d))
        assert any(f.endswith(".swp") for f in files), files
    if opts.get("param") == "nvme":
        _assert_params_on_disk(engine, got, opts["max_in_cpu"], opts.get("param_buffers", 5))
    if opts.get("optimizer", "nvme") != "nvme":
        return engine._core.last_step_times()
    # On disk: nothing of the master or the state is held in memory between steps.
    for key in ("master_weights", "optimizer_state", "host_master_weights", "host_optimizer_state"):
        assert got[key] == 0, (key, got)
    # Host memory: the staging buffers (at most buffer_count, each a 4 KiB header, a sub-group's
    # master and two Adam moments, each padded to 4 KiB, plus one alignment's slack) and the pool's
    # gradient and 16-bit buffers (reused by byte size; per sub-group size at most two gradient
    # buffers, the next one's copy and this one's, and two uploads in flight).
    sub_groups = [sg for g in range(len(engine.optimizer.param_groups)) for sg in engine._core.sub_groups(g)]
    assert all(where == "nvme" for _, _, where in sub_groups), sub_groups
    largest = max(n for _, n, _ in sub_groups)
    staging = opts.get("buffer_count", 4) * (4096 + 3 * (-(-largest * 4 // 4096) * 4096) + 4096)
    pooled = 4 * sum(n * 4 for n in {n for _, n, _ in sub_groups})
    # (With parameters on NVMe the same pool holds their staging buffers too, whose count
    # _assert_params_on_disk bounds by offload_param.buffer_count.)
    if opts.get("param") != "nvme":
        assert got["host_buffers"] <= staging + pooled, (got, staging, pooled)
    return engine._core.last_step_times()


def _assert_params_on_disk(engine, got, max_in_cpu, buffer_count):
    """Between steps the parameter chunks in host memory are at most max_in_cpu elements (no
    parameter is persistent here), as accounted and as the kernel reports the chunk store's pages
    (each chunk may share a page at either end with a neighbour that is resident, and the model's
    chunks span several pages, so most of the store is really given back); the chunks really went
    to disk and came back, read ahead along the module order from the second iteration on, through
    at most buffer_count staging buffers at once."""
    stats = engine._core.param_swap_stats()
    params = list(engine.module.parameters())
    element = 4 if params[0].dtype == torch.float32 else 2
    world = int(os.environ["WORLD_SIZE"])
    store = sum(-(-p.ds_numel // world) for p in params) * element
    assert got["parameters"] == 0, got
    assert stats["persistent_numel"] == 0, stats
    assert stats["resident_numel"] <= max_in_cpu, stats
    assert got["host_parameters"] == stats["resident_numel"] * element, (got, stats)
    assert stats["mapped_bytes"] <= got["host_parameters"] + 2 * 4096 * len(params) + 4096, (got, stats)
    assert stats["mapped_bytes"] - got["host_parameters"] < store // 2, (store, got, stats)
    assert stats["reads"] > 0 and stats["writes"] > 0 and stats["prefetched"] > 0, stats
    assert 1 <= stats["peak_lent"] <= buffer_count, stats


def nvme_parity_batch_worker(cases, path):
    for case_id, stage, precision, gas, _, opts in cases:
        try:
            nvme_parity_worker(stage, precision, gas, os.path.join(path, case_id), opts)
        except Exception as e:
            raise AssertionError(f"case {case_id}: {e}") from e


# Every stage in fp32 and bf16, worlds 1 and 2, the pipeline on and off, and two staging buffers
# (reads wait for writes to free one).
CASES = [
    # id                          stage precision gas world options
    ("s1-fp32-gas1-w1",           1, "fp32", 1, 1, {}),
    ("s3-bf16-gas2-w1-serial",    3, "bf16", 2, 1, {"pipeline": False}),
    ("s1-bf16-gas2-w2",           1, "bf16", 2, 2, {}),
    ("s2-fp32-gas1-w2-2buffers",  2, "fp32", 1, 2, {"buffer_count": 2}),
    ("s2-bf16-gas1-w2-serial",    2, "bf16", 1, 2, {"pipeline": False}),
    ("s3-fp32-gas2-w2",           3, "fp32", 2, 2, {}),
    ("s3-bf16-gas1-w2-param-cpu", 3, "bf16", 1, 2, {"param": "cpu"}),
    # Parameters on NVMe too: none kept in host memory, some kept, two staging buffers; with the
    # optimizer in host memory (the step hands new values to the swap) and on the device.
    # (gpt-wide: chunks that span pages, so the chunks that go to disk give their memory back.)
    ("s3-fp32-gas1-w1-param-nvme",       3, "fp32", 1, 1, {"param": "nvme", "max_in_cpu": 0, "model": "gpt-wide"}),
    ("s3-bf16-gas2-w1-param-nvme-cpu",   3, "bf16", 2, 1, {"param": "nvme", "max_in_cpu": 5000, "model": "gpt-wide",
                                                            "optimizer": "cpu", "param_buffers": 2}),
    ("s3-bf16-gas2-w2-param-nvme",       3, "bf16", 2, 2, {"param": "nvme", "max_in_cpu": 0, "model": "gpt-wide",
                                                            "param_buffers": 2}),
    ("s3-fp32-gas1-w2-param-nvme-dev",   3, "fp32", 1, 2, {"param": "nvme", "max_in_cpu": 3000, "model": "gpt-wide",
                                                            "optimizer": "none"}),
]


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_parity(world, tmp_path):
    cases = [c for c in CASES if c[4] == world]
    for c in cases:
        (tmp_path / c[0]).mkdir()
    run_distributed(nvme_parity_batch_worker, world, cases, str(tmp_path), timeout=300)
    for c in cases:  # a clean exit removed every rank's directory
        assert _swap_dirs(tmp_path / c[0]) == [], c[0]
