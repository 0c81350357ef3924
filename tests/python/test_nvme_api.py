"""Optimizer state and parameters on NVMe (issue 20) through the APIs DeepSpeed scripts call
around training: zeroshard.utils' safe_get/set_full_* (the state is read from and written to its
swap files), zero.Init(remote_device="nvme") with from_pretrained's GatheredParameters load, and
save_checkpoint / load_checkpoint between NVMe, CPU offload and no offload. As test_offload_api.py
does: the same script with and without NVMe on 2 ranks, every tensor within 1e-6 of its scale,
and a loaded checkpoint restored exactly and continued as the run that saved it went on."""
import os

import pytest
import torch

import checkpoint_workers as W
from harness import run_distributed
from test_offload_api import (NONE, OPT, _assert_close, _cfg, _check_residency, _compare_with_and_without,
                              utils_worker, zero_init_worker)

SAVE_AT, END = 3, 6


def _nvme(path):
    # 1000-element sub-groups: each rank's state is several regions of its file.
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), "pipeline_read": True,
                                  "pipeline_write": True, "buffer_count": 2},
            "sub_group_size": 1000}


def _nvme_params(path, max_in_cpu=2000):
    """Parameters on NVMe too (stage 3), few of them kept in host memory, two staging buffers."""
    return {**_nvme(path), "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": max_in_cpu,
                                             "buffer_count": 2}}


@pytest.mark.parametrize("stage,params", [(2, False), (3, False), (3, True)])
def test_safe_get_and_set_full_values_with_nvme(stage, params, tmp_path):
    # With parameters on NVMe, a model whose chunks span pages, so chunks really leave memory.
    offload = _nvme_params(tmp_path) if params else _nvme(tmp_path)
    _compare_with_and_without(utils_worker, offload, stage, "gpt-wide" if params else "gpt")


def test_zero_init_on_nvme_with_a_from_pretrained_load_trains_like_a_normal_build(tmp_path):
    """DeepSpeed's ZeRO-Infinity recipe: the model built under zero.Init(remote_device="nvme",
    config_dict_or_path=ds_config), its weights copied in under GatheredParameters(modifier_rank=0)
    as from_pretrained does (the chunks written go to disk), then trained."""
    _compare_with_and_without(zero_init_worker, _nvme_params(tmp_path, max_in_cpu=0), "nvme", "gpt-wide")


def ck_worker(root, nvme_path, stage=2, params=False):
    """Saves at SAVE_AT from an NVMe run and from a plain one, goes on to END; then loads each
    checkpoint into the other residency (NVMe -> none and CPU offload, none -> NVMe). `params`:
    the parameters on NVMe too (stage 3)."""
    offloads = {"nvme": _nvme_params(nvme_path) if params else _nvme(nvme_path), "none": NONE, "cpu": OPT}
    model = "gpt-wide" if params else "gpt"  # chunks that span pages: they really leave memory
    saved = {}
    for name in ("nvme", "none"):
        engine = W.build(model, _cfg(stage, offloads[name]))
        losses = W.train(engine, model, 0, SAVE_AT)
        snap = W.snapshot(engine)
        engine.save_checkpoint(os.path.join(root, name))
        losses += W.train(engine, model, SAVE_AT, END)
        _check_residency(engine, offloads[name])
        saved[name] = {"saved": snap, "losses": losses, "end": W.snapshot(engine)}
    loaded = {}
    for case, (ck, into) in {"nvme->none": ("nvme", "none"), "nvme->cpu": ("nvme", "cpu"),
                             "none->nvme": ("none", "nvme"), "nvme->nvme": ("nvme", "nvme")}.items():
        engine = W.build(model, _cfg(stage, offloads[into]))
        engine.load_checkpoint(os.path.join(root, ck))
        snap = W.snapshot(engine)
        losses = W.train(engine, model, SAVE_AT, END)
        _check_residency(engine, offloads[into])
        loaded[case] = (ck, {"loaded": snap, "losses": losses, "end": W.snapshot(engine)})
    return saved, loaded


@pytest.mark.parametrize("stage,params", [(2, False), (3, True)])
def test_checkpoints_move_between_nvme_and_memory_and_continue_uninterrupted(stage, params, tmp_path):
    root, nvme = tmp_path / "ck", tmp_path / "nvme"
    root.mkdir()
    nvme.mkdir()
    for rank, (saved, loaded) in enumerate(run_distributed(ck_worker, 2, str(root), str(nvme), stage, params,
                                                           timeout=300)):
        for case, (ck, got) in loaded.items():
            run = saved[ck]
            _assert_close(got["loaded"], run["saved"], f"{case} rank {rank}, just after load", tol=0.0)
            _assert_close(got["losses"], run["losses"][SAVE_AT:], f"{case} rank {rank}, losses after load")
            _assert_close(got["end"], run["end"], f"{case} rank {rank}, at step {END}")


# ----- two parameter groups, and part of the state on the device (ratio < 1) --------------------

def groups_worker(offload):
    """The usual weight-decay split into two parameter groups, 4 steps; everything a resume needs."""
    from models import tiny_gpt
    model = tiny_gpt()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    import zeroshard
    engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config=_cfg(2, offload))
    losses = W.train(engine, "gpt", 0, 4)
    if offload:
        residencies = {where for g in range(2) for _, _, where in engine._core.sub_groups(g)}
        assert residencies == {"device", "nvme"}, residencies  # the split really happened
    return {"losses": losses, "end": W.snapshot(engine)}


def test_two_parameter_groups_with_part_of_the_state_on_nvme(tmp_path):
    offload = _nvme(tmp_path)
    offload["offload_optimizer"]["ratio"] = 0.5
    _compare_with_and_without(groups_worker, offload)


# ----- after an I/O error: no half-written checkpoint, and no step on a half-updated state ------

def save_fault_worker(root, nvme_path, engine_kind):
    """`engine_kind`: whose read fails, the optimizer state's or (stage 3, parameters on NVMe with
    none kept in host memory) a parameter chunk's."""
    import zeroshard
    params = engine_kind == "param"
    stage, model = (3, "gpt-wide") if params else (2, "gpt")
    offload = _nvme_params(nvme_path, max_in_cpu=0) if params else _nvme(nvme_path)
    engine = W.build(model, _cfg(stage, offload))
    W.train(engine, model, 0, 2)
    engine.save_checkpoint(root, tag="good")
    engine._core.inject_nvme_fault("eio:read:1", engine_kind)  # the save's first read fails
    with pytest.raises(RuntimeError, match=r"Input/output error"):
        engine.save_checkpoint(root, tag="bad")
    assert not os.path.exists(os.path.join(root, "bad")), os.listdir(root)
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "good"
    # The failed save changed nothing: the next one holds the state the run goes on from.
    engine.save_checkpoint(root, tag="again")
    want = W.snapshot(engine)
    fresh = W.build(model, _cfg(stage, offload))
    fresh.load_checkpoint(root, tag="again")
    _assert_close(W.snapshot(fresh), want, "reloaded", tol=0.0)
    return zeroshard is not None


@pytest.mark.parametrize("engine_kind", ["optimizer", "param"])
def test_a_save_that_meets_an_io_error_leaves_no_checkpoint_and_the_next_one_is_whole(tmp_path, engine_kind):
    root, nvme = tmp_path / "ck", tmp_path / "nvme"
    root.mkdir()
    nvme.mkdir()
    run_distributed(save_fault_worker, 1, str(root), str(nvme), engine_kind)


def step_fault_worker(root, nvme_path):
    engine = W.build("gpt", _cfg(2, {**_nvme(nvme_path), "sub_group_size": 1000}))
    W.train(engine, "gpt", 0, 1)
    engine._core.inject_nvme_fault("eio:write:2")  # part of the next step's state reaches disk
    with pytest.raises(RuntimeError, match=r"Input/output error"):
        W.train(engine, "gpt", 1, 3)
    # Some sub-groups took that step and some did not: nothing may build on it.
    for attempt in (lambda: W.train(engine, "gpt", 3, 4), lambda: engine.save_checkpoint(root)):
        with pytest.raises(RuntimeError, match=r"restart from the last checkpoint") as info:
            attempt()
        assert "rank 0" in str(info.value) and "Input/output error" in str(info.value), info.value
    assert not os.listdir(root)


def test_after_a_failed_step_the_run_refuses_to_step_or_save(tmp_path):
    root, nvme = tmp_path / "ck", tmp_path / "nvme"
    root.mkdir()
    nvme.mkdir()
    run_distributed(step_fault_worker, 1, str(root), str(nvme))


def one_tensor_worker(nvme_path):
    """Each safe_get/set of one tensor reads (and writes) its own sub-group only: with the second
    read from now armed to fail, the first call goes through and the second fails."""
    from zeroshard.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
    engine = W.build("gpt", _cfg(1, _nvme(nvme_path)))
    W.train(engine, "gpt", 0, 1)
    params = [p for p in engine.module.parameters() if p.numel() > 1000]  # each alone in a sub-group
    before = safe_get_full_optimizer_state(params[0], "exp_avg")
    engine._core.inject_nvme_fault("eio:read:2")
    value = safe_get_full_fp32_param(params[0])
    with pytest.raises(RuntimeError, match="Input/output error"):
        safe_get_full_fp32_param(params[1])
    engine._core.inject_nvme_fault("eio:write:2")
    safe_set_full_fp32_param(params[0], value + 1)  # reads and writes params[0]'s sub-group
    assert torch.equal(safe_get_full_fp32_param(params[0]), value + 1)
    assert torch.equal(safe_get_full_optimizer_state(params[0], "exp_avg"), before)  # state kept


def test_safe_get_and_set_of_one_tensor_touch_only_its_sub_group(tmp_path):
    run_distributed(one_tensor_worker, 1, str(tmp_path))
