"""The `deepspeed` compatibility distribution (compat/deepspeed), installed as a user installs it
(the compat_python fixture): its version and metadata, that transformers and accelerate count it as
DeepSpeed, that DeepSpeed's module paths are zeroshard's own module objects, that what Hugging Face,
pipeline scripts and Megatron-DeepSpeed import resolves, that what zeroshard lacks fails with the
reason, and that it refuses to replace a real DeepSpeed."""
import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

import zeroshard

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
COMPAT = os.path.join(ROOT, "compat", "deepspeed")
VERSION = f"0.19.8+zeroshard.{zeroshard.__version__}"
PIP_ENV = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

# DeepSpeed module -> the module object it must be.
LEAVES = {
    "deepspeed.comm": "zeroshard.comm",
    "deepspeed.runtime.engine": "zeroshard.engine",
    "deepspeed.runtime.lr_schedules": "zeroshard.lr_schedules",
    "deepspeed.runtime.zero.partition_parameters": "zeroshard.zero.partition_init",
    "deepspeed.utils.zero_to_fp32": "zeroshard.utils.zero_to_fp32",
    "deepspeed.checkpoint.utils": "zeroshard.checkpoint.utils",
    "deepspeed.ops.adam": "zeroshard.ops.adam",
    "deepspeed.ops.adagrad": "zeroshard.ops.adagrad",
    "deepspeed.ops.lion": "zeroshard.ops.lion",
    "deepspeed.launcher.runner": "zeroshard.launcher.runner",
    "deepspeed.zero": "deepspeed.runtime.zero",  # as in DeepSpeed: `from .runtime import zero`
}

# DeepSpeed package -> the zeroshard module whose __all__ it re-exports (the same objects).
PACKAGES = {
    "deepspeed": "zeroshard",
    "deepspeed.runtime.zero": "zeroshard.zero",
    "deepspeed.utils": "zeroshard.utils",
    "deepspeed.ops": "zeroshard.ops",
    "deepspeed.launcher": "zeroshard.launcher",
    "deepspeed.accelerator": "zeroshard.accelerator",
}

# What transformers 5.23 and accelerate 1.15 take from `deepspeed` (grep their sources for
# "from deepspeed" and "deepspeed\."), less what REFUSED covers.
HF_USES = [
    "from deepspeed.utils import logger as ds_logger",
    # prevent_arange_dtype_change() reads and re-assigns this under ZeRO-3 from_pretrained.
    "from deepspeed.runtime.zero import partition_parameters as pp; pp.zero_wrapper_for_fp_tensor_constructor",
    "from deepspeed.ops.adam import DeepSpeedCPUAdam",
    "from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad",
    "from deepspeed.ops.lion import DeepSpeedCPULion",
    "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME",
    "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save",
    "from deepspeed.accelerator import get_accelerator",
    "from deepspeed import comm as dist; dist.get_rank",
    "from deepspeed import DeepSpeedEngine",
    "from deepspeed.runtime.engine import DeepSpeedEngine",
    "from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec",
    "from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, ProcessTopology",
    "from deepspeed.runtime.pipe.engine import PipelineEngine",
    "import deepspeed; deepspeed.checkpointing.checkpoint; deepspeed.checkpointing.configure",
    "from deepspeed.runtime.activation_checkpointing import checkpointing",
    "import deepspeed.runtime.lr_schedules; deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "import deepspeed; deepspeed.initialize; deepspeed.zero.Init; deepspeed.zero.GatheredParameters; "
    "deepspeed.zero.register_external_parameter; deepspeed.runtime.zero.GatheredParameters",
]

# What DeepSpeed pipeline scripts, GPT-NeoX and Megatron-DeepSpeed take from `deepspeed` beyond that
# (Megatron-DeepSpeed: `isinstance(model, deepspeed.PipelineEngine)`, checkpointing's RNG tracker).
SCRIPT_USES = [
    "import deepspeed, zeroshard.pipe as p, zeroshard.pipe.engine as e; "
    "assert deepspeed.PipelineEngine is e.PipelineEngine and deepspeed.PipelineModule is p.PipelineModule; "
    "assert not isinstance(object(), deepspeed.PipelineEngine)",
    "from deepspeed import PipelineModule, PipelineEngine",
    "import deepspeed.runtime.pipe as rp, zeroshard.pipe as p; "
    "assert [getattr(rp, n) for n in ('PipelineModule', 'LayerSpec', 'TiedLayerSpec', 'ProcessTopology')] == "
    "[p.PipelineModule, p.LayerSpec, p.TiedLayerSpec, p.ProcessTopology]",
    "from deepspeed.runtime.pipe import ProcessTopology",
    "from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid",
    "from deepspeed.checkpointing import (configure, is_configured, checkpoint, non_reentrant_checkpoint, "
    "get_cuda_rng_tracker, model_parallel_cuda_manual_seed, CudaRNGStatesTracker, _set_cuda_rng_state)",
    "import deepspeed; t = deepspeed.checkpointing.get_cuda_rng_tracker(); "
    "assert t is deepspeed.runtime.activation_checkpointing.checkpointing.get_cuda_rng_tracker()",
    # GPT-NeoX's module-level imports (megatron/utils.py, training.py, neox_arguments/arguments.py).
    "from deepspeed.launcher.runner import fetch_hostfile, parse_inclusion_exclusion, DLTS_HOSTFILE; "
    "assert DLTS_HOSTFILE == '/job/hostfile' and fetch_hostfile('/nonexistent/hostfile') is None; "
    "assert parse_inclusion_exclusion({'a': 2, 'b': 2}, 'a:1@b', '') == {'a': [1], 'b': [0, 1]}; "
    "assert parse_inclusion_exclusion({'a': 2, 'b': 2}, '', 'b:0') == {'a': [0, 1], 'b': [1]}",
    "from deepspeed.runtime.bf16_optimizer import BF16_Optimizer; import torch; "
    "assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), BF16_Optimizer)",
    "from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler",
]

# (statement, its entry in deepspeed/_unsupported.py, the exception it must raise)
REFUSED = [
    ("from deepspeed.utils import groups", "deepspeed.utils.groups", "ImportError"),
    ("from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF",
     "deepspeed.runtime.sequence_parallel", "ImportError"),
    ("import deepspeed.moe", "deepspeed.moe", "ImportError"),
    ("import deepspeed.inference", "deepspeed.inference", "ImportError"),
    ("import deepspeed; deepspeed.moe", "deepspeed.moe", "AttributeError"),  # so hasattr() is False
    ("import deepspeed; deepspeed.tp_model_init(model=None, tp_size=2)", "deepspeed.tp_model_init",
     "NotImplementedError"),
    ("import deepspeed; deepspeed.init_inference(None)", "deepspeed.init_inference", "NotImplementedError"),
    ("from deepspeed.runtime.pipe import schedule", "deepspeed.runtime.pipe.schedule", "ImportError"),
    ("from deepspeed.runtime.pipe.schedule import TrainSchedule", "deepspeed.runtime.pipe.schedule", "ImportError"),
    ("import deepspeed; deepspeed.runtime.pipe.schedule", "deepspeed.runtime.pipe.schedule", "AttributeError"),
    ("from deepspeed.runtime.bf16_optimizer import BF16_Optimizer; BF16_Optimizer(None)",
     "deepspeed.runtime.bf16_optimizer.BF16_Optimizer", "NotImplementedError"),
    ("from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler; CurriculumScheduler({})",
     "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler", "NotImplementedError"),
]

# Reached as attributes after a bare `import deepspeed`, as accelerate does with
# deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES.
ATTRIBUTE_PATHS = [
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.pipe.PipelineModule",
    "deepspeed.runtime.pipe.topology.PipeDataParallelTopology",
    "deepspeed.runtime.zero.GatheredParameters",
    "deepspeed.runtime.zero.partition_parameters.Init",
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.launcher.runner.main",
    "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.PipelineEngine",
    "deepspeed.PipelineModule",
    "deepspeed.runtime.pipe.ProcessTopology",
    "deepspeed.checkpointing.get_cuda_rng_tracker",
]

FACTS = {
    # These two run first, before other snippets import submodules.
    # The launcher path (the `deepspeed` command) must not import torch, as zeroshard's does not.
    "torch_after_launcher": "import sys, deepspeed.launcher.runner; result = 'torch' in sys.modules",
    "unreached_attributes": (
        "import deepspeed, functools; result = []\n"
        f"for path in {ATTRIBUTE_PATHS!r}:\n"
        "    try: functools.reduce(getattr, path.split('.')[1:], deepspeed)\n"
        "    except AttributeError as e: result.append(f'{path}: {e}')"),
    "metadata_version": "import importlib.metadata as m; result = m.version('deepspeed')",
    "requires": "import importlib.metadata as m; result = m.requires('deepspeed')",
    "spec_origin": "import importlib.util as u; result = u.find_spec('deepspeed').origin",
    "module_version": "import deepspeed; result = [deepspeed.__version__, deepspeed.version]",
    "transformers": "from transformers.integrations import is_deepspeed_available as f; result = f()",
    "transformers_gate": "from transformers.dependency_versions_check import dep_version_check; "
                         "dep_version_check('deepspeed'); result = True",
    "accelerate": "from accelerate.utils import is_deepspeed_available as f; result = f()",
    "table": "from deepspeed._unsupported import UNSUPPORTED; result = sorted(UNSUPPORTED)",
}


def _leaf_snippet(ds, target):
    return f"import importlib; result = importlib.import_module({ds!r}) is importlib.import_module({target!r})"


def _package_snippet(ds, zs):
    return (f"import importlib; ds, zs = importlib.import_module({ds!r}), importlib.import_module({zs!r}); "
            "result = sorted(n for n in zs.__all__ if n != '__version__' and getattr(ds, n, None) is not "
            "getattr(zs, n))")


def _message_snippet(key):
    return f"from deepspeed._unsupported import message; result = message({key!r})"


@pytest.fixture(scope="module")
def probe(compat_python, tmp_path_factory):
    """Every snippet above run once, in order, in one process of the compat virtualenv."""
    snippets = (list(FACTS.values()) + [_leaf_snippet(*kv) for kv in LEAVES.items()]
                + [_package_snippet(*kv) for kv in PACKAGES.items()] + HF_USES + SCRIPT_USES
                + [s for s, _, _ in REFUSED] + [_message_snippet(k) for _, k, _ in REFUSED])
    folder = tmp_path_factory.mktemp("probe")
    (folder / "in.json").write_text(json.dumps(snippets))
    subprocess.run([compat_python, os.path.join(HERE, "compat_probe.py"), str(folder / "in.json"),
                    str(folder / "out.json")], check=True, cwd=folder)
    return json.loads((folder / "out.json").read_text())


def _result(probe, snippet):
    outcome = probe[snippet]
    assert outcome["error"] is None, f"{snippet}: {outcome['error'][0]}: {outcome['error'][1]}"
    return outcome["result"]


def test_version_metadata_and_spec(probe, compat_python):
    fact = {name: _result(probe, FACTS[name])
            for name in ("torch_after_launcher", "metadata_version", "requires", "spec_origin", "module_version")}
    assert fact["metadata_version"] == VERSION
    assert fact["module_version"] == [VERSION, VERSION]
    assert fact["requires"] == [f"zeroshard=={zeroshard.__version__}"]
    venv = os.path.dirname(os.path.dirname(compat_python))
    assert fact["spec_origin"].startswith(venv) and fact["spec_origin"].endswith("deepspeed/__init__.py")
    assert fact["torch_after_launcher"] is False


def test_submodules_reached_as_attributes(probe):
    assert _result(probe, FACTS["unreached_attributes"]) == []


@pytest.mark.parametrize("check", ["transformers", "transformers_gate", "accelerate"])
def test_hugging_face_counts_it_as_deepspeed(probe, check):
    assert _result(probe, FACTS[check]) is True


@pytest.mark.parametrize("ds,target", LEAVES.items())
def test_leaf_module_is_zeroshards_own(probe, ds, target):
    assert _result(probe, _leaf_snippet(ds, target)) is True, f"{ds} is a copy, not {target} itself"


@pytest.mark.parametrize("ds,zs", PACKAGES.items())
def test_package_reexports_zeroshards_names(probe, ds, zs):
    assert _result(probe, _package_snippet(ds, zs)) == [], f"{ds} lacks (or has other objects for) these"


@pytest.mark.parametrize("snippet", HF_USES)
def test_what_hugging_face_uses_resolves(probe, snippet):
    _result(probe, snippet)


@pytest.mark.parametrize("snippet", SCRIPT_USES)
def test_what_pipeline_and_megatron_scripts_use_resolves(probe, snippet):
    _result(probe, snippet)


@pytest.mark.parametrize("snippet,key,error", REFUSED)
def test_unsupported_fails_with_the_reason(probe, snippet, key, error):
    message = _result(probe, _message_snippet(key))
    assert "not supported by zeroshard" in message and "Instead: " in message
    assert probe[snippet]["error"] == [error, message]


def test_every_unsupported_name_is_tested(probe):
    assert _result(probe, FACTS["table"]) == sorted({key for _, key, _ in REFUSED})


def test_deepspeed_command_is_zeroshards_launcher(compat_python):
    command = os.path.join(os.path.dirname(compat_python), "deepspeed")
    out = subprocess.run([command, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--num_gpus" in out and "--hostfile" in out


def test_reinstall_over_its_own_install(compat_python):
    pip = subprocess.run([compat_python, "-m", "pip", "install", "-q", "--no-deps", COMPAT], env=PIP_ENV,
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr


def _site_packages(python):
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("isolation", [[], ["--no-build-isolation"]])
def test_refuses_to_replace_a_real_deepspeed(tmp_path, isolation):
    # A virtualenv holding a stand-in DeepSpeed 0.19.8 (a hand-written dist-info); it borrows the
    # outer pip through --system-site-packages rather than paying for ensurepip.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path)],
                   check=True)
    python = str(tmp_path / "bin" / "python")
    site = _site_packages(python)
    init, info = os.path.join(site, "deepspeed", "__init__.py"), os.path.join(site, "deepspeed-0.19.8.dist-info")
    os.makedirs(os.path.dirname(init))
    os.makedirs(info)
    with open(init, "w") as f:
        f.write('__version__ = "0.19.8"\n')
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("deepspeed/__init__.py,,\ndeepspeed-0.19.8.dist-info/METADATA,,\ndeepspeed-0.19.8.dist-info/RECORD,,\n")

    pip = subprocess.run([python, "-m", "pip", "install", "--no-deps", *isolation, COMPAT], env=PIP_ENV,
                         capture_output=True, text=True)
    output = " ".join((pip.stdout + pip.stderr).split())  # pip wraps long lines
    assert pip.returncode != 0
    for part in (f"DeepSpeed 0.19.8 is installed in {site}", "would replace it",
                 f"{python} -m pip uninstall deepspeed", "separate virtual environment"):
        assert part in output, output
    assert sorted(n for n in os.listdir(site) if n.startswith("deepspeed")) == ["deepspeed", "deepspeed-0.19.8.dist-info"]
    with open(init) as f:
        assert f.read() == '__version__ = "0.19.8"\n'


def _load_backend(directory, module_name):
    spec = importlib.util.spec_from_file_location(
        module_name, os.path.join(directory, "backend", "deepspeed_compat_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sdist_builds_the_same_wheel(tmp_path):
    backend = _load_backend(COMPAT, "compat_backend_tree")
    wheel_name = backend.build_wheel(str(tmp_path))
    assert wheel_name == f"deepspeed-{VERSION}-py3-none-any.whl"
    sdist_name = backend.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / sdist_name) as sdist:
        sdist.extractall(tmp_path / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    # Outside the repository, the version comes from the sdist's PKG-INFO.
    unpacked = _load_backend(str(tmp_path / "unpacked" / f"deepspeed-{VERSION}"), "compat_backend_sdist")
    (tmp_path / "from_sdist").mkdir()
    assert unpacked.build_wheel(str(tmp_path / "from_sdist")) == wheel_name
    built = (tmp_path / wheel_name).read_bytes()
    assert (tmp_path / "from_sdist" / wheel_name).read_bytes() == built

    with zipfile.ZipFile(io.BytesIO(built)) as wheel:
        names = set(wheel.namelist())
        info = f"deepspeed-{VERSION}.dist-info"
        assert {"deepspeed/__init__.py", "deepspeed/_version.py", f"{info}/METADATA", f"{info}/WHEEL",
                f"{info}/RECORD"} <= names
        assert {n.split("/")[0] for n in names} == {"deepspeed", info}
        record = list(csv.reader(io.StringIO(wheel.read(f"{info}/RECORD").decode())))
        assert {row[0] for row in record} == names
        for path, digest, size in record:
            if path == f"{info}/RECORD":
                continue
            data = wheel.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, size) == (f"sha256={expected}", str(len(data))), path


def test_zeroshard_itself_never_claims_deepspeed():
    # This python (no compat install needed): zeroshard's distribution ships no `deepspeed` top level.
    dist = importlib.metadata.distribution("zeroshard")
    assert dist.metadata["Name"] == "zeroshard"
    top_levels = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    assert not any(t.startswith("deepspeed") for t in top_levels), top_levels
    assert "deepspeed" not in (dist.read_text("top_level.txt") or "").split()
    assert "zeroshard" not in importlib.metadata.packages_distributions().get("deepspeed", [])
    # Nor does its editable finder map the name: `deepspeed` here is absent or some other distribution's.
    spec = importlib.util.find_spec("deepspeed")
    assert spec is None or not os.path.realpath(spec.origin or "").startswith(os.path.join(ROOT, "python"))
