"""Checkpoint shard files are Hugging Face safetensors files: the `safetensors` package reads what
zeroshard's C++ writer wrote, and zeroshard's C++ reader reads what the package wrote. The C++
side is the hidden Catch2 case "[.interop]" of tests/cpp/runtime/test_checkpoint_safetensors.cpp,
found in the CMake build folder: $ZEROSHARD_CPP_BUILD_DIR, else build/ (what `make build` makes)."""
import math
import os
import subprocess

import pytest
import torch

st = pytest.importorskip("safetensors.torch", reason="pip install safetensors to check file interop")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = "runtime_test_checkpoint_safetensors"

# The C++ test's kCases: name, dtype, shape (a 13-byte U8 misaligns what follows; empty tensors).
CASES = [
    ("f32.2x3", torch.float32, [2, 3]), ("bf16.5", torch.bfloat16, [5]), ("u8.13", torch.uint8, [13]),
    ("f16.3x1x2", torch.float16, [3, 1, 2]), ("f64.7", torch.float64, [7]), ("i64.4", torch.int64, [4]),
    ("i32.empty", torch.int32, [0, 3]), ("bool.6", torch.bool, [6]), ("scalar", torch.float32, []),
    ("i8.2x2", torch.int8, [2, 2]), ("i16.3", torch.int16, [3]), ("f8e4m3.4", torch.float8_e4m3fn, [4]),
    ("c64.2", torch.complex64, [2]), ("empty.last", torch.float32, [0]),
]


def pattern(dtype, shape, seed):
    """tests/cpp/runtime/checkpoint_helpers.h's pattern(): same formula, same libtorch."""
    base = torch.arange(math.prod(shape), dtype=torch.float64)
    if dtype == torch.bool:
        values = (base + seed).remainder(3).eq(0)
    elif dtype.is_floating_point or dtype.is_complex:
        values = (base * 0.37 + seed).sin() * 3.0
    else:
        values = (base * 7 + seed * 13).remainder(101)
    return values.to(dtype).reshape(shape)


def same(a, b):
    """Same dtype, shape and bytes (NaN-safe, and defined for every dtype above)."""
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


@pytest.fixture(scope="module")
def cpp_binary():
    build = os.environ.get("ZEROSHARD_CPP_BUILD_DIR", os.path.join(ROOT, "build"))
    path = os.path.join(build, "tests", "cpp", BINARY)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not built (build the C++ tests, or set ZEROSHARD_CPP_BUILD_DIR)")
    return path


def run_interop(binary, **env):
    result = subprocess.run([binary, "[.interop]"], env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_safetensors_loads_what_zeroshard_wrote(cpp_binary, tmp_path):
    path = str(tmp_path / "zeroshard.safetensors")
    run_interop(cpp_binary, ZS_SAFETENSORS_WRITE=path)
    loaded = st.load_file(path)
    assert set(loaded) == {name for name, _, _ in CASES}
    for name, dtype, shape in CASES:
        assert same(loaded[name], pattern(dtype, shape, 7)), name
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "written_by": "zeroshard"}


def test_zeroshard_reads_what_safetensors_wrote(cpp_binary, tmp_path):
    path = str(tmp_path / "huggingface.safetensors")
    st.save_file({name: pattern(dtype, shape, 8) for name, dtype, shape in CASES}, path, metadata={"format": "pt"})
    run_interop(cpp_binary, ZS_SAFETENSORS_READ=path)
