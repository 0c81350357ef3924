"""zeroshard.utils.zero_to_fp32 and the `zeroshard-consolidate` command (run here as
`python -m zeroshard.utils.zero_to_fp32`): consolidating a checkpoint saved at world 2 under ZeRO
stages 1 and 3, fp32 and bf16, gives the model's full fp32 state_dict exactly; sharded output comes
with Hugging Face's index; DeepSpeed's checkpoints consolidate too; bad input is named; and peak
memory stays near the largest tensor on a model many times larger."""
import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from harness import run_distributed
from models import global_batch, tiny_gpt

st = pytest.importorskip("safetensors.torch", reason="pip install safetensors to read the output")
from safetensors import safe_open  # noqa: E402

from zeroshard import _C  # noqa: E402
from zeroshard.utils.zero_to_fp32 import (  # noqa: E402
    INDEX_FILE, SINGLE_FILE, Consolidated, convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint, parse_size)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
DS_CASES = sorted(n for n in os.listdir(DS_FIXTURES) if os.path.isfile(os.path.join(DS_FIXTURES, n, "latest")))
SCENARIOS = [(1, "fp32"), (1, "bf16"), (3, "fp32"), (3, "bf16")]
CLI = [sys.executable, "-m", "zeroshard.utils.zero_to_fp32"]


def model_with_extras():
    """tiny_gpt (tied head) plus an int and a float buffer and a frozen parameter."""
    model = tiny_gpt()
    model.register_buffer("ids", torch.arange(5))
    model.register_buffer("gain", torch.linspace(0, 1, 6))
    model.pos.weight.requires_grad_(False)
    return model


def _train_and_save(stage, precision, save_dir):
    import zeroshard
    from zeroshard.checkpoint.layout import RunView
    from zeroshard.zero import GatheredParameters
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = model_with_extras()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
           "steps_per_print": 100}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    for step in range(2):
        loss = engine(global_batch("gpt", step, 2 * world)[2 * rank: 2 * rank + 2])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    engine.save_checkpoint(save_dir, tag="nofrozen", save_latest=False, exclude_frozen_parameters=True)
    # The model's full fp32 state_dict: the masters of trainable parameters, the rest as the module holds it.
    run, values = RunView.of(engine), engine._core.full_values
    want = {n: values.get(i, "fp32_param").numpy() for i, (n, t) in enumerate(zip(run.names, run.trainable)) if t}
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    with GatheredParameters([p for _, p in frozen]):
        want.update((n, p.detach().float().numpy().copy()) for n, p in frozen)
    for n, b in engine.module.named_buffers():
        want[n] = (b.float() if b.is_floating_point() else b).numpy().copy()
    want["head.weight"] = want["tok.weight"]
    return want, list(engine.module.state_dict().keys())


@functools.lru_cache(maxsize=None)
def saved(stage, precision):
    """(save_dir, expected state_dict as numpy, the module's state_dict keys) for one scenario."""
    save_dir = tempfile.mkdtemp(prefix=f"consolidate_s{stage}_{precision}_")
    atexit.register(shutil.rmtree, save_dir, True)
    want, keys = run_distributed(_train_and_save, 2, stage, precision, save_dir)[0]
    return save_dir, want, keys


def cli(*args, check=True):
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(CLI + list(map(str, args)))} failed ({r.returncode}):\n{r.stderr}")
    return r


def assert_same(got, want, dtype=torch.float32):
    assert set(got) == set(want)
    for name, w in want.items():
        w = torch.from_numpy(np.asarray(w))
        w = w.to(dtype) if w.is_floating_point() else w
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name


@pytest.mark.parametrize("stage,precision", SCENARIOS)
def test_state_dict_equals_the_models(stage, precision):
    save_dir, want, keys = saved(stage, precision)
    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert sorted(sd) == sorted(keys)
    assert_same(sd, want)
    assert sd["head.weight"] is sd["tok.weight"]  # tied, as DeepSpeed returns them
    without = get_fp32_state_dict_from_zero_checkpoint(save_dir, exclude_frozen_parameters=True)
    assert set(without) == set(keys) - {"pos.weight"}
    saved_without = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="nofrozen")
    assert set(saved_without) == set(keys) - {"pos.weight"}


@pytest.mark.parametrize("stage,precision", SCENARIOS)
def test_command_writes_the_models_state_dict(stage, precision, tmp_path):
    save_dir, want, _ = saved(stage, precision)
    r = cli(save_dir, tmp_path)
    assert "tensors" in r.stderr and SINGLE_FILE in r.stderr  # the progress bar and the summary
    assert sorted(os.listdir(tmp_path)) == [SINGLE_FILE]
    assert_same(st.load_file(str(tmp_path / SINGLE_FILE)), want)


def test_sharded_output_has_huggingfaces_index(tmp_path):
    save_dir, want, _ = saved(3, "bf16")
    (tmp_path / SINGLE_FILE).write_bytes(b"stale")  # from an earlier unsharded run: removed
    cli(save_dir, tmp_path, "--max-shard-size", "3kB", "--quiet")
    with open(tmp_path / INDEX_FILE) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(os.listdir(tmp_path)) == sorted(files + [INDEX_FILE])
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    got, total = {}, 0
    for name in files:
        part = st.load_file(str(tmp_path / name))
        assert all(index["weight_map"][k] == name for k in part)
        assert os.path.getsize(tmp_path / name) < 3000 + 1024 or len(part) == 1  # a big tensor goes alone
        total += sum(t.numel() * t.element_size() for t in part.values())
        got.update(part)
    assert index["metadata"]["total_size"] == total
    assert_same(got, want)
    cli(save_dir, tmp_path, "--quiet")  # back to one file: the shards and index go
    assert sorted(os.listdir(tmp_path)) == [SINGLE_FILE]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype(dtype, tmp_path):
    save_dir, want, _ = saved(1, "fp32")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cli(save_dir, tmp_path, "--dtype", dtype, "--exclude-frozen-parameters", "--quiet")
    got = st.load_file(str(tmp_path / SINGLE_FILE))
    assert got["ids"].dtype == torch.int64  # integer buffers keep their dtype
    assert_same(got, {k: v for k, v in want.items() if k != "pos.weight"}, torch_dtype)


def test_reads_no_optimizer_state():
    save_dir, _, _ = saved(3, "bf16")
    c = Consolidated(save_dir)
    for e in c.entries:
        c.read(e, reuse=True)
    assert {e.key.split("/")[0] for e in c.entries} == {"master", "param", "buffer"}
    assert c.source.reader.bytes_read == sum(e.numel * e.stored_dtype.itemsize for e in c.entries)


def test_load_state_dict_from_zero_checkpoint():
    save_dir, want, _ = saved(3, "bf16")
    model = load_state_dict_from_zero_checkpoint(model_with_extras(), save_dir)
    assert_same(model.state_dict(), want)
    assert model.head.weight is model.tok.weight


@pytest.mark.parametrize("case", DS_CASES)
def test_deepspeed_checkpoint(case, tmp_path):
    """DeepSpeed's own tensors (expected.safetensors): fp32 masters, frozen weights, buffers."""
    expected = st.load_file(os.path.join(DS_FIXTURES, case, "expected.safetensors"))
    names = {k.split("/", 1)[1] for k in expected if k.startswith(("param/", "buffer/"))}
    want = {}
    for n in names:
        t = expected.get(f"master/{n}", expected.get(f"param/{n}", expected.get(f"buffer/{n}")))
        want[n] = t.float().numpy() if t.is_floating_point() else t.numpy()
    cli(os.path.join(DS_FIXTURES, case), tmp_path, "--quiet")
    assert_same(st.load_file(str(tmp_path / SINGLE_FILE)), want)
    assert_same(get_fp32_state_dict_from_zero_checkpoint(os.path.join(DS_FIXTURES, case)), want)


def test_bad_input_is_named(tmp_path):
    save_dir, _, _ = saved(1, "fp32")
    missing = tmp_path / "nowhere"
    for args, message in [
        ((missing, tmp_path / "o"), f"{missing}: no such checkpoint directory"),
        ((save_dir, tmp_path / "o", "--tag", "step9"), "tag 'step9'"),
        ((tmp_path, tmp_path / "o"), "no 'latest' file"),
        ((save_dir, tmp_path / "o", "--max-shard-size", "lots"), "max_shard_size: got 'lots'"),
    ]:
        r = cli(*args, check=False)
        assert r.returncode == 1 and message in r.stderr, (args, r.stderr)
    (tmp_path / "junk").mkdir()
    with pytest.raises(FileNotFoundError, match="junk: not a checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="junk")
    with pytest.raises(ValueError, match="safe_serialization"):
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "o", safe_serialization=False)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234

    # A corrupted shard file: the checksum error names the file and the tensor, and no output is left.
    broken = tmp_path / "broken"
    shutil.copytree(save_dir, broken)
    shard = broken / "global_step2" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = cli(broken, tmp_path / "out", check=False)
    assert r.returncode == 1 and "rank00001.safetensors" in r.stderr and "checksum" in r.stderr, r.stderr
    assert os.listdir(tmp_path / "out") == []


# ----- memory: streaming, never the model -----------------------------------------------------------

NUM_TENSORS, TENSOR_NUMEL = 40, 2 * 2**20  # 40 x 8 MiB fp32 = 320 MiB


def _big_value(k):
    return torch.arange(TENSOR_NUMEL, dtype=torch.float32).mul_(k + 1).view(1024, -1)


def _write_big_checkpoint(save_dir, tag="big"):
    """A zeroshard checkpoint of NUM_TENSORS fp32 parameters, four per file, written with the
    storage layer directly (a world-1 engine would take longer to make it)."""
    os.makedirs(os.path.join(save_dir, tag))
    manifest, params = None, []
    for f in range(NUM_TENSORS // 4):
        items = []
        for k in range(4 * f, 4 * f + 4):
            name, value = f"layers.{k}.weight", _big_value(k)
            params.append({"name": name, "shape": list(value.shape), "trainable": True, "group": 0})
            items.append((f"param/{name}", list(value.shape), 0, value.reshape(-1)))
        part = _C.checkpoint.write_shard_file(os.path.join(save_dir, tag, f"rank{f:05d}.safetensors"), items)
        manifest = part if manifest is None else (manifest.merge(part) or manifest)
    manifest.set_section("layout", {"world_size": NUM_TENSORS // 4, "zero_stage": 3, "dtype": "fp32",
                                    "params": params, "buffers": [], "aliases": {}, "frozen_excluded": False})
    manifest.validate_complete(os.path.join(save_dir, tag))
    manifest.save(os.path.join(save_dir, tag, _C.checkpoint.MANIFEST))
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


_PEAK_RSS = ("import resource, subprocess, sys\n"
             "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "sys.stderr.write(r.stderr)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
             "sys.exit(r.returncode)\n")


def peak_rss_bytes(command):
    """The peak resident set of `command`, measured by a fresh helper process that only runs it."""
    r = subprocess.run([sys.executable, "-c", _PEAK_RSS] + command, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    save_dir, out = tmp_path / "ckpt", tmp_path / "out"
    _write_big_checkpoint(str(save_dir))
    largest = TENSOR_NUMEL * 4
    model_bytes = NUM_TENSORS * largest
    baseline = peak_rss_bytes([sys.executable, "-c", "import zeroshard, torch"])
    peak = peak_rss_bytes(CLI + [str(save_dir), str(out), "--max-shard-size", "100MB"])
    peak_bf16 = peak_rss_bytes(CLI + [str(save_dir), str(tmp_path / "bf16"), "--dtype", "bf16"])  # casts too
    mib = 2**20
    print(f"\nconsolidation peak RSS: model {model_bytes / mib:.0f} MiB in {NUM_TENSORS} tensors, largest "
          f"{largest / mib:.0f} MiB; baseline (import zeroshard, torch) {baseline / mib:.0f} MiB; peak "
          f"{peak / mib:.0f} MiB (+{(peak - baseline) / mib:.0f}), with --dtype bf16 {peak_bf16 / mib:.0f} MiB "
          f"(+{(peak_bf16 - baseline) / mib:.0f})")
    for p in (peak, peak_bf16):
        assert p - baseline < 4 * largest + 64 * mib
        assert p - baseline < model_bytes / 3
    with open(out / INDEX_FILE) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) == 4  # 11 x 8 MiB per 100 MB file
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), _big_value(int(key.split(".")[1]))), key
