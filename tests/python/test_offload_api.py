"""CPU offload (issue 19) through the APIs DeepSpeed scripts call around training: zero.Init,
GatheredParameters(modifier_rank=0), save_16bit_model, zeroshard.utils' safe_get/set_full_* and
save_checkpoint / load_checkpoint across offload configs. Each case runs the same script with and
without offload on 2 ranks and compares: every tensor within 1e-6 of its scale, bf16 included (the
host and the device step do the same arithmetic; today they agree bit for bit), counters exactly,
and what a checkpoint load restores bit for bit."""
import os

import numpy as np
import pytest
import torch

import checkpoint_workers as W
from harness import run_distributed
from models import MODELS, global_batch, tiny_gpt
from test_offload_parity import _assert_residency

TOL = 1e-6
NONE = {}
OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
BOTH = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
# The tiny GPT is 7136 elements: 1000-element sub-groups give each rank's shard several, so with
# ratio 0.4 some step on the host and some on the device.
PARTIAL = {"offload_optimizer": {"device": "cpu", "ratio": 0.4}, "sub_group_size": 1000}
OFFLOADS = {"none": NONE, "opt": OPT, "both": BOTH, "partial": PARTIAL}


def _cfg(stage, offload, precision="fp32", **zero):
    return W.config(stage, precision, extra={"zero_optimization": {**offload, **zero}})


def _check_residency(engine, offload):
    """Where the config puts the state, so that a run ignoring the offload blocks cannot pass."""
    opt = offload.get("offload_optimizer")
    param = offload.get("offload_param")
    if param and param["device"] == "nvme":  # host memory holds at most max_in_cpu elements of them
        stats, got = engine._core.param_swap_stats(), engine.memory_bytes()
        assert stats["resident_numel"] - stats["persistent_numel"] <= param["max_in_cpu"], stats
        assert stats["reads"] > 0 and got["parameters"] == 0, stats
        # The pages of chunks on disk really went back (the model's chunks span pages).
        world = int(os.environ["WORLD_SIZE"])
        store = sum(-(-p.ds_numel // world) * p.element_size() for p in engine.module.parameters())
        assert stats["mapped_bytes"] - got["host_parameters"] < store // 2, (store, got, stats)
    if opt and opt["device"] == "nvme":  # on disk: in no memory between steps
        got = engine.memory_bytes()
        assert all(got[k] == 0 for k in ("master_weights", "optimizer_state", "host_master_weights",
                                         "host_optimizer_state")), got
        return
    _assert_residency(engine, optimizer=opt is not None, param="offload_param" in offload,
                      ratio=opt.get("ratio", 1.0) if opt else 1.0)


def _assert_close(got, want, what, tol=TOL):
    """Nested dicts / lists of numpy arrays and numbers: arrays within tol of their scale."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_close(got[k], want[k], f"{what}/{k}", tol)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_close(a, b, f"{what}[{i}]", tol)
    elif isinstance(want, np.ndarray):
        assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
        err = float(np.abs(got - want).max()) if want.size else 0.0
        scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-12)
        assert err <= tol * scale, f"{what}: differs by {err:.3e} (scale {scale:.3e})"
    elif isinstance(want, float):
        assert abs(got - want) <= tol * max(abs(want), 1e-12), f"{what}: {got!r} != {want!r}"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _both(worker, offload, *args):
    """The worker with `offload`, then the same worker without offload, in one process."""
    return worker(offload, *args), worker(NONE, *args)


def _compare_with_and_without(worker, offload, *args, tol=TOL):
    for rank, (got, want) in enumerate(run_distributed(_both, 2, worker, offload, *args, timeout=300)):
        _assert_close(got, want, f"rank {rank}", tol)


# ----- 1. zero.Init -------------------------------------------------------------------------------

def zero_init_worker(offload, remote_device=None, model_name="gpt"):
    """With offload: the model is built under zero.Init(config_dict_or_path=cfg) and its weights
    loaded as from_pretrained loads them (rank 0 copies them in under GatheredParameters with
    modifier_rank=0: GPT's own init runs after zero.Init has partitioned each layer, so it draws
    other numbers); without, built whole as usual. Both train 4 steps."""
    import zeroshard
    from zeroshard.zero import GatheredParameters
    cfg = _cfg(3, offload)
    if offload:
        with zeroshard.zero.Init(config_dict_or_path=cfg, remote_device=remote_device):
            model = MODELS[model_name]()
        params = list(model.parameters())
        assert all(p.numel() < p.ds_numel for p in params)  # built partitioned
        with GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p, whole in zip(params, MODELS[model_name]().parameters()):
                p.copy_(whole)
    else:
        model = MODELS[model_name]()
    engine = W.build_module(model, cfg)
    losses = W.train(engine, model_name, 0, 4)
    _check_residency(engine, offload)
    return {"losses": losses, "end": W.snapshot(engine)}


def test_zero_init_with_both_offloads_trains_like_a_normal_build():
    _compare_with_and_without(zero_init_worker, BOTH)


# ----- 2. GatheredParameters(modifier_rank=0) after initialize ------------------------------------

def gathered_edit_worker(offload):
    """Two steps, then every rank edits blocks.0.fc.weight inside GatheredParameters(modifier_rank=0)
    (rank 0's edit must win), then two more steps from the edited weight."""
    from zeroshard.utils import safe_get_full_fp32_param
    from zeroshard.zero import GatheredParameters
    rank = int(os.environ["RANK"])
    engine = W.build("gpt", _cfg(3, offload))
    W.train(engine, "gpt", 0, 2)
    weight = engine.module.blocks[0].fc.weight
    edit = torch.randn(weight.ds_shape, generator=torch.Generator().manual_seed(7)) * 0.1
    with GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.copy_(edit + rank)
    with GatheredParameters([weight]):
        seen = weight.detach().clone()
    assert torch.equal(seen, edit), f"rank {rank}: the gathered weight is not rank 0's edit"
    assert torch.equal(safe_get_full_fp32_param(weight), edit), f"rank {rank}: the master is not the edit"
    edited = W.snapshot(engine)
    losses = W.train(engine, "gpt", 2, 4)
    _check_residency(engine, offload)
    return {"edited": edited, "losses": losses, "end": W.snapshot(engine)}


def test_gathered_parameters_edit_with_both_offloads_is_what_training_continues_from():
    _compare_with_and_without(gathered_edit_worker, BOTH)


# ----- 3. save_16bit_model ------------------------------------------------------------------------

def save_16bit_worker(offload, stage, precision, root):
    import torch.distributed as dist
    engine = W.build("gpt", _cfg(stage, offload, precision, stage3_gather_16bit_weights_on_model_save=True))
    W.train(engine, "gpt", 0, 3)
    out_dir = os.path.join(root, "offload" if offload else "plain")
    assert engine.save_16bit_model(out_dir, "model.bin") is True
    _check_residency(engine, offload)
    dist.barrier()  # rank 0 writes the file; every rank reads it back
    saved = torch.load(os.path.join(out_dir, "model.bin"), weights_only=True)
    return {"keys": list(saved), "dtypes": [str(t.dtype) for t in saved.values()],
            "values": {n: W._np(t) for n, t in saved.items()},
            "tied": saved["tok.weight"] is saved["head.weight"]}


SAVE_16BIT_CASES = {  # id -> (stage, offload, precision)
    "s3-both-fp32": (3, BOTH, "fp32"),
    "s3-both-bf16": (3, BOTH, "bf16"),
    "s2-opt-fp32": (2, OPT, "fp32"),
    "s2-opt-bf16": (2, OPT, "bf16"),
}


@pytest.mark.parametrize("case", list(SAVE_16BIT_CASES))
def test_save_16bit_model_with_offload_writes_the_plain_runs_file(case, tmp_path):
    stage, offload, precision = SAVE_16BIT_CASES[case]
    _compare_with_and_without(save_16bit_worker, offload, stage, precision, str(tmp_path))


# ----- 4. zeroshard.utils safe_get/set_full_* -----------------------------------------------------

SET_FP32 = ("tok.weight", "blocks.0.fc.bias", "blocks.1.out.weight", "ln_f.bias")  # first to last
SET_STATE = (("tok.weight", "exp_avg"), ("blocks.1.fc.weight", "exp_avg_sq"), ("ln_f.weight", "exp_avg"))


def _full_values(named, with_grad=False):
    from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state)
    out = {}
    for n, p in named.items():
        out[n] = {"fp32": W._np(safe_get_full_fp32_param(p)),
                  **{k: W._np(safe_get_full_optimizer_state(p, k)) for k in ("exp_avg", "exp_avg_sq")}}
        if with_grad:
            out[n]["grad"] = W._np(safe_get_full_grad(p))
    return out


def utils_worker(offload, stage, model_name="gpt"):
    """Gradients before a step, values and states after it, then rank 0's values set (every rank
    passes another one) into masters and moments from the first sub-group to the last, and two
    more steps that must start from them."""
    from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state)
    rank = int(os.environ["RANK"])
    engine = W.build(model_name, _cfg(stage, offload))
    named = dict(engine.module.named_parameters())
    W.train(engine, model_name, 0, 2)
    engine.backward(engine(global_batch(model_name, 2, 4)[2 * rank:2 * rank + 2]))
    out = {"before_step": _full_values(named, with_grad=True)}
    engine.step()
    out["after_step"] = _full_values(named)

    def value(name, seed, positive=False):
        shape = named[name].ds_shape if stage == 3 else named[name].shape
        v = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.01
        return v.abs() if positive else v

    with torch.no_grad():
        for i, name in enumerate(SET_FP32):
            want = value(name, i)
            safe_set_full_fp32_param(named[name], want + rank)  # rank 0's wins
            assert torch.equal(safe_get_full_fp32_param(named[name]), want), f"rank {rank}: {name}"
        for i, (name, key) in enumerate(SET_STATE):
            want = value(name, 100 + i, positive=key == "exp_avg_sq") * 1e-2
            safe_set_full_optimizer_state(named[name], want + rank, key)
            assert torch.equal(safe_get_full_optimizer_state(named[name], key), want), f"rank {rank}: {name} {key}"
    out["set"] = _full_values(named)
    out["losses"] = W.train(engine, model_name, 3, 5)
    out["end"] = _full_values(named)
    _check_residency(engine, offload)
    return out


@pytest.mark.parametrize("stage,offload", [(2, OPT), (3, BOTH), (2, PARTIAL), (3, PARTIAL)],
                         ids=["s2-opt", "s3-both", "s2-partial", "s3-partial"])
def test_safe_get_and_set_full_values_with_offload(stage, offload):
    _compare_with_and_without(utils_worker, offload, stage)


# ----- 5. checkpoints across offload configs ------------------------------------------------------

SAVE_AT, END = 3, 6
# name -> (stage, offload) of the runs that save at SAVE_AT and then go on, uninterrupted, to END
CK_SAVES = {"s2-opt": (2, "opt"), "s3-both": (3, "both"), "s2-none": (2, "none"), "s3-none": (3, "none"),
            "s3-partial": (3, "partial")}
# id -> (checkpoint, offload of the engine that loads it; its stage is the checkpoint's)
CK_LOADS = {
    "s2-opt->none": ("s2-opt", "none"),
    "s3-both->none": ("s3-both", "none"),
    "s2-none->opt": ("s2-none", "opt"),
    "s3-none->both": ("s3-none", "both"),
    "s2-opt->partial": ("s2-opt", "partial"),
    "s3-both->partial": ("s3-both", "partial"),
    "s3-partial->both": ("s3-partial", "both"),
}


def ck_save_worker(root):
    out = {}
    for name, (stage, offload) in CK_SAVES.items():
        engine = W.build("gpt", _cfg(stage, OFFLOADS[offload]))
        losses = W.train(engine, "gpt", 0, SAVE_AT)
        saved = W.snapshot(engine)
        engine.save_checkpoint(os.path.join(root, name))
        losses += W.train(engine, "gpt", SAVE_AT, END)
        _check_residency(engine, OFFLOADS[offload])
        out[name] = {"saved": saved, "losses": losses, "end": W.snapshot(engine)}
    return out


@pytest.fixture(scope="module")
def ck_saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload_ck"))
    return root, run_distributed(ck_save_worker, 2, root, timeout=300)


def ck_load_worker(root, name, offload):
    stage = CK_SAVES[name][0]
    engine = W.build("gpt", _cfg(stage, OFFLOADS[offload]))
    path, _ = engine.load_checkpoint(os.path.join(root, name))
    assert path == os.path.join(root, name, f"global_step{SAVE_AT}"), path
    loaded = W.snapshot(engine)
    losses = W.train(engine, "gpt", SAVE_AT, END)
    _check_residency(engine, OFFLOADS[offload])
    return {"loaded": loaded, "losses": losses, "end": W.snapshot(engine)}


@pytest.mark.parametrize("case", list(CK_LOADS))
def test_checkpoint_loads_across_offload_configs_and_continues_uninterrupted(case, ck_saved):
    root, saved = ck_saved
    name, offload = CK_LOADS[case]
    for rank, got in enumerate(run_distributed(ck_load_worker, 2, root, name, offload, timeout=240)):
        run = saved[rank][name]
        # What was saved comes back unchanged, in the new residency...
        _assert_close(got["loaded"], run["saved"], f"{case} rank {rank}, just after load", tol=0.0)
        # ... and training goes on as the run that saved went on without stopping.
        _assert_close(got["losses"], run["losses"][SAVE_AT:], f"{case} rank {rank}, losses after load")
        _assert_close(got["end"], run["end"], f"{case} rank {rank}, at step {END}")
