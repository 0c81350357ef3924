"""Optimizer state on NVMe (issue 20) through the APIs DeepSpeed scripts call around training:
zeroshard.utils' safe_get/set_full_* (the state is read from and written to its swap files) and
save_checkpoint / load_checkpoint between NVMe, CPU offload and no offload. As test_offload_api.py
does: the same script with and without NVMe on 2 ranks, every tensor within 1e-6 of its scale,
and a loaded checkpoint restored exactly and continued as the run that saved it went on."""
import os

import pytest

import checkpoint_workers as W
from harness import run_distributed
from test_offload_api import NONE, OPT, _assert_close, _cfg, _check_residency, _compare_with_and_without, utils_worker

SAVE_AT, END = 3, 6


def _nvme(path):
    # 1000-element sub-groups: each rank's state is several regions of its file.
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), "pipeline_read": True,
                                  "pipeline_write": True, "buffer_count": 2},
            "sub_group_size": 1000}


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_get_and_set_full_values_with_nvme(stage, tmp_path):
    _compare_with_and_without(utils_worker, _nvme(tmp_path), stage)


def ck_worker(root, nvme_path):
    """Saves at SAVE_AT from an NVMe run and from a plain one, goes on to END; then loads each
    checkpoint into the other residency (NVMe -> none and CPU offload, none -> NVMe)."""
    offloads = {"nvme": _nvme(nvme_path), "none": NONE, "cpu": OPT}
    saved = {}
    for name in ("nvme", "none"):
        engine = W.build("gpt", _cfg(2, offloads[name]))
        losses = W.train(engine, "gpt", 0, SAVE_AT)
        snap = W.snapshot(engine)
        engine.save_checkpoint(os.path.join(root, name))
        losses += W.train(engine, "gpt", SAVE_AT, END)
        _check_residency(engine, offloads[name])
        saved[name] = {"saved": snap, "losses": losses, "end": W.snapshot(engine)}
    loaded = {}
    for case, (ck, into) in {"nvme->none": ("nvme", "none"), "nvme->cpu": ("nvme", "cpu"),
                             "none->nvme": ("none", "nvme"), "nvme->nvme": ("nvme", "nvme")}.items():
        engine = W.build("gpt", _cfg(2, offloads[into]))
        engine.load_checkpoint(os.path.join(root, ck))
        snap = W.snapshot(engine)
        losses = W.train(engine, "gpt", SAVE_AT, END)
        _check_residency(engine, offloads[into])
        loaded[case] = (ck, {"loaded": snap, "losses": losses, "end": W.snapshot(engine)})
    return saved, loaded


def test_checkpoints_move_between_nvme_and_memory_and_continue_uninterrupted(tmp_path):
    root, nvme = tmp_path / "ck", tmp_path / "nvme"
    root.mkdir()
    nvme.mkdir()
    for rank, (saved, loaded) in enumerate(run_distributed(ck_worker, 2, str(root), str(nvme), timeout=300)):
        for case, (ck, got) in loaded.items():
            run = saved[ck]
            _assert_close(got["loaded"], run["saved"], f"{case} rank {rank}, just after load", tol=0.0)
            _assert_close(got["losses"], run["losses"][SAVE_AT:], f"{case} rank {rank}, losses after load")
            _assert_close(got["end"], run["end"], f"{case} rank {rank}, at step {END}")
