"""zeroshard.checkpoint_import.deepspeed reads the checkpoints DeepSpeed 0.19 wrote in
tests/fixtures/deepspeed/ (made by make_fixture.py there) exactly as DeepSpeed's own API reported
them at save time, and refuses bad files with errors that name them, without running their code."""
import contextlib
import functools
import json
import os
import shutil
import sys
import types

import pytest
import torch

from zeroshard.checkpoint.sources import find_checkpoint
from zeroshard.checkpoint_import.deepspeed import (
    DeepSpeedCheckpoint, is_deepspeed_checkpoint, load_file)

st = pytest.importorskip("safetensors.torch", reason="pip install safetensors to read the expected tensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
CASES = sorted(n for n in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, n, "expected.json")))


def test_every_fixture_is_found():
    assert CASES == ["zero1_bf16", "zero1_fp32", "zero2_bf16", "zero2_bf16_aligned", "zero2_fp32", "zero3_bf16",
                     "zero3_fp32"]


@functools.lru_cache(maxsize=None)
def loaded(case):
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        expected = json.load(f)
    path, _ = find_checkpoint(os.path.join(FIXTURES, case))
    return DeepSpeedCheckpoint(path), expected, st.load_file(os.path.join(FIXTURES, case, "expected.safetensors"))


@pytest.mark.parametrize("case", CASES)
def test_tensors_equal_deepspeeds_own(case):
    ckpt, info, tensors = loaded(case)
    for key, want in tensors.items():
        got = ckpt.tensor(key)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    # and expected.safetensors covers every tensor the checkpoint has
    kinds = ["param"] + ["master"] + [f"optim/{s}" for s in ckpt.optimizer_state_names]
    have = {f"param/{n}" for n in ckpt.param_names}
    have |= {f"{k}/{n}" for k in kinds[1:] for n in ckpt.param_names if n not in ckpt.frozen_names}
    have |= {f"buffer/{n}" for n in ckpt.buffer_names}
    assert have == set(tensors)
    assert "deepspeed" not in sys.modules


@pytest.mark.parametrize("case", CASES)
def test_layout_facts(case):
    ckpt, info, tensors = loaded(case)
    assert (ckpt.world_size, ckpt.zero_stage, ckpt.dtype) == (info["world_size"], info["zero_stage"], info["dtype"])
    assert ckpt.param_names == info["param_names"]
    assert ckpt.frozen_names == set(info["frozen_names"])
    assert ckpt.buffer_names == info["buffer_names"]
    assert ckpt.optimizer_state_names == ["exp_avg", "exp_avg_sq"]
    for name in ckpt.param_names:
        assert ckpt.shape(name) == tensors[f"param/{name}"].shape
    for frozen in ckpt.frozen_names:
        with pytest.raises(KeyError, match="frozen"):
            ckpt.tensor(f"master/{frozen}")


@pytest.mark.parametrize("case", CASES)
def test_sections_equal_what_deepspeed_reported(case):
    ckpt, info, _ = loaded(case)
    sections = json.loads(json.dumps(ckpt.sections()))  # plain JSON values, and nothing else
    assert sections["training_state"] == {k: info[k] for k in ("global_steps", "global_samples", "skipped_steps")}
    assert sections["lr_scheduler"] == info["lr_scheduler"]
    assert sections["client_state"] == info["client_state"]
    assert sections["loss_scaler"].get("scale") == info["loss_scale"]
    assert sections["optimizer"]["type"] == info["optimizer_type"]
    assert sections["optimizer"]["step"] == info["optimizer_step"]
    assert sections["optimizer"]["param_groups"] == info["param_groups"]
    assert sections["deepspeed"]["version"] == info["deepspeed_version"]


def test_find_and_recognise(tmp_path):
    load_dir = os.path.join(FIXTURES, "zero2_fp32")
    tag_dir = os.path.join(load_dir, "step3")
    assert find_checkpoint(load_dir) == (tag_dir, "step3")  # DeepSpeed's `latest`, read as zeroshard's
    assert find_checkpoint(load_dir, tag="step3") == (tag_dir, "step3")
    assert find_checkpoint(str(tmp_path)) == (None, None)  # no `latest`: nothing to load, as DeepSpeed
    with pytest.raises(FileNotFoundError, match="global_step9"):
        find_checkpoint(load_dir, tag="global_step9")
    assert is_deepspeed_checkpoint(tag_dir)
    assert is_deepspeed_checkpoint(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    assert not is_deepspeed_checkpoint(load_dir) and not is_deepspeed_checkpoint(str(tmp_path))


def copy_of(case, tmp_path):
    path = tmp_path / case
    shutil.copytree(os.path.join(FIXTURES, case, "step3"), path)
    return path


def test_missing_directory_and_load_dir_given(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        DeepSpeedCheckpoint(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="find_checkpoint"):
        DeepSpeedCheckpoint(os.path.join(FIXTURES, "zero3_fp32"))


@pytest.mark.parametrize("case, removed", [
    ("zero2_fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("zero3_fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("zero2_bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
])
def test_missing_rank_file_is_named(tmp_path, case, removed):
    path = copy_of(case, tmp_path)
    os.remove(path / removed)
    with pytest.raises(FileNotFoundError, match=removed):
        DeepSpeedCheckpoint(str(path))


def test_truncated_file_is_named(tmp_path):
    path = copy_of("zero3_fp32", tmp_path)
    victim = path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: .*truncated"):
        DeepSpeedCheckpoint(str(path))


def test_file_that_is_not_deepspeeds(tmp_path):
    path = copy_of("zero1_fp32", tmp_path)
    torch.save({"weight": torch.zeros(3)}, path / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt: not a DeepSpeed model states file"):
        DeepSpeedCheckpoint(str(path))


class RunsCode:
    """Pickles as a call of os.system: what a malicious checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_disallowed_global_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = copy_of("zero2_fp32", tmp_path)
    victim = path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"partition_count": [2, 2], "x": RunsCode(marker)}}, victim)
    name = f"{os.system.__module__}.{os.system.__name__}"  # posix.system on Linux
    with pytest.raises(ValueError, match=rf"optim_states\.pt: refused: .*{name}.*loading code from a checkpoint"):
        DeepSpeedCheckpoint(str(path))
    # the same as a plain pickle: not a torch.save archive, refused before any unpickling
    plain = tmp_path / "plain.pt"
    import pickle
    plain.write_bytes(pickle.dumps({"x": RunsCode(marker)}))
    with pytest.raises(ValueError, match="plain.pt: not a torch.save archive"):
        load_file(str(plain))
    assert not marker.exists()


@contextlib.contextmanager
def pickled_under_deepspeeds_names():
    """While open, pickle writes the reader's stand-ins under DeepSpeed's module paths, as DeepSpeed
    writes its own classes (fake, empty `deepspeed.*` modules; all undone on exit)."""
    from zeroshard.checkpoint_import.deepspeed import ALLOWED_GLOBALS
    saved_modules = dict(sys.modules)
    saved_names = [(cls, cls.__module__, cls.__qualname__) for cls, _ in ALLOWED_GLOBALS]
    try:
        for cls, qualified in ALLOWED_GLOBALS:
            module_name, _, name = qualified.rpartition(".")
            parts = module_name.split(".")
            for depth in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
            setattr(sys.modules[module_name], name, cls)
            cls.__module__, cls.__qualname__ = module_name, name
        yield
    finally:
        for cls, module_name, name in saved_names:
            cls.__module__, cls.__qualname__ = module_name, name
        for added in set(sys.modules) - set(saved_modules):
            del sys.modules[added]


def resave(path, edit):
    """DeepSpeed file `path` rewritten with edit(state) applied, its classes pickled under DeepSpeed's
    names (not in place: the loaded state maps the old file's pages)."""
    with pickled_under_deepspeeds_names():
        state = load_file(str(path))
        edit(state)
        torch.save(state, f"{path}.new")
        os.replace(f"{path}.new", path)


def test_dynamic_loss_scaler(tmp_path):
    """fp16 runs pickle a DynamicLossScaler; no fixture has one (DeepSpeed's CPU accelerator refuses
    fp16 without oneDNN fp16), so re-save a fixture with one."""
    from zeroshard.checkpoint_import.deepspeed import DynamicLossScaler
    scaler = DynamicLossScaler()
    fields = dict(cur_scale=1024.0, cur_iter=3, last_overflow_iter=1, scale_factor=2.0, scale_window=1000,
                  min_scale=1.0, delayed_shift=2, cur_hysteresis=2, consecutive_hysteresis=False,
                  raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    scaler.__dict__.update(fields)
    path = copy_of("zero2_fp32", tmp_path)
    for rank in (0, 1):
        resave(path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               lambda state: state["optimizer_state_dict"].update(loss_scaler=scaler, dynamic_loss_scale=True))
    assert "deepspeed" not in sys.modules
    section = DeepSpeedCheckpoint(str(path)).sections()["loss_scaler"]
    fields.update(scale=fields.pop("cur_scale"), dtype="float16")
    assert section == fields


def test_unknown_names(tmp_path):
    ckpt = loaded("zero2_fp32")[0]
    with pytest.raises(KeyError, match="no such parameter"):
        ckpt.tensor("param/nope")
    with pytest.raises(KeyError, match="expected param/<name>"):
        ckpt.tensor("weights/fc1.weight")
    with pytest.raises(KeyError, match="no optimizer state 'momentum'"):
        ckpt.tensor("optim/momentum/fc1.weight")


def test_damaged_optimizer_state_is_named_and_refused_only_where_it_is_read(tmp_path):
    """A rank's Adam state missing, a moment too short, a group's state gone on every rank: the
    checkpoint still opens (its weights and masters are whole, so a load without the optimizer
    state, or a consolidation, needs nothing else); the optimizer state is marked unread with the
    file and what is wrong, and the reader refuses its optim/ tensors."""
    from zeroshard.checkpoint.sources import DeepSpeedSource
    files = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]

    def state(o, group=0):
        return o["base_optimizer_state"]["state"][group]
    damages = {  # damage -> (files to edit, edit, what state_problem says)
        "rank 1 without state": (files[1:], lambda o: o["base_optimizer_state"].__setitem__("state", {}),
                                 f"{files[1]}: flat group 0 holds no state where {files[0]}'s flat group 0 "
                                 "holds ['exp_avg', 'exp_avg_sq']"),
        "a short moment": (files[1:], lambda o: state(o).__setitem__("exp_avg_sq", state(o)["exp_avg_sq"][:3]),
                           f"{files[1]}: flat group 0's exp_avg_sq holds 2 elements, expected its partition's 537"),
        "group 1 gone everywhere": (files, lambda o: o["base_optimizer_state"]["state"].__setitem__(1, {}),
                                    f"{files[0]}: flat group 1 holds no state where {files[0]}'s flat group 0"),
    }
    path = copy_of("zero2_fp32", tmp_path)
    for damage, (victims, edit, said) in damages.items():
        for name in files:
            shutil.copy(os.path.join(FIXTURES, "zero2_fp32", "step3", name), path / name)
        for name in victims:
            resave(path / name, lambda state: edit(state["optimizer_state_dict"]))
        ckpt = DeepSpeedCheckpoint(str(path))
        assert ckpt.state_problem.startswith("the optimizer state is damaged: ") and said in ckpt.state_problem, \
            (damage, ckpt.state_problem)
        trained = next(n for n in ckpt.param_names if n not in ckpt.frozen_names)
        assert torch.equal(ckpt.tensor(f"master/{trained}"), loaded("zero2_fp32")[0].tensor(f"master/{trained}"))
        with pytest.raises(ValueError, match="the optimizer state is damaged"):
            ckpt.tensor(f"optim/exp_avg/{trained}")
        unread = DeepSpeedSource(str(path)).section("layout")["optimizer"]["unread"]
        assert unread.startswith(f"{path}: the optimizer state is damaged") and said in unread
    assert DeepSpeedCheckpoint(os.path.join(FIXTURES, "zero2_fp32", "step3")).state_problem is None


def test_a_muon_checkpoint_is_named_not_called_damaged(tmp_path):
    """DeepSpeed's Muon marks its param groups use_muon (its Muon group keeps momentum_buffer, over
    whole matrices at ZeRO-1/2, its Adam group the moments): the files are rewritten so (group 0 the
    Muon group), and the reason says Muon, not damage; the weights and masters still read."""
    from zeroshard.checkpoint.sources import DeepSpeedSource
    path = copy_of("zero2_fp32", tmp_path)

    def muon(state):
        base = state["optimizer_state_dict"]["base_optimizer_state"]
        for g, group in enumerate(base["param_groups"]):
            group.update(use_muon=g == 0, name="muon-params" if g == 0 else "adam-params")
        moments = base["state"][0]
        moments["momentum_buffer"] = torch.cat([moments.pop("exp_avg"), moments.pop("exp_avg_sq")])
    for r in (0, 1):
        resave(path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", muon)
    ckpt = DeepSpeedCheckpoint(str(path))
    assert ckpt.state_problem.startswith("it was saved by DeepSpeed's Muon optimizer"), ckpt.state_problem
    unread = DeepSpeedSource(str(path)).section("layout")["optimizer"]["unread"]
    assert unread == f"{path}: {ckpt.state_problem}"
    trained = next(n for n in ckpt.param_names if n not in ckpt.frozen_names)
    assert torch.equal(ckpt.tensor(f"master/{trained}"), loaded("zero2_fp32")[0].tensor(f"master/{trained}"))
    # An elastic checkpoint saves no param groups: its config says Muon (any case, as DeepSpeed reads it).
    path = copy_of("zero2_fp32", tmp_path / "elastic")
    resave(path / "mp_rank_00_model_states.pt", lambda state: state["ds_config"].__setitem__(
        "optimizer", {"type": "muon", "params": {"lr": 0.01}}))
    assert DeepSpeedCheckpoint(str(path)).state_problem.startswith("it was saved by DeepSpeed's Muon optimizer")
