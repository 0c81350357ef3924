#!/usr/bin/env bash
# The GPU machine's checks in one command (the `device` tool lends it for minutes; see
# bench/RESULTS.md). That machine has torch, nvcc, cmake and ninja but no registry: the
# nlohmann_json and Catch2 headers come in a prefix (.devprefix: include/, lib/cmake/Catch2,
# share/cmake/nlohmann_json, libCatch2WithMain.a, copied from Debian's packages), DeepSpeed and
# the packages it needs that the machine lacks as wheels (.whl). Both are .gitignored.
#
#   build from source (CUDA kernels where nvcc matches torch) -> the `cuda` tests on 8 workers ->
#   ctest -> bench/pipeline.py at 2 and 4 stages with the peers, on the CPU cores (CUDA hidden:
#   the pipeline's multi-rank runs use Gloo; NCCL needs a GPU per rank and there is one)
#
#   bench/gpu_check.sh [--no-bench]     (BUDGET_S: the seconds the whole script may take, 570)
#
# Logs go to $OUT (the device tool brings them back), one file per part.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
start=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

say "machine: $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
say "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'); $(nvcc --version | tail -1)"

say "build"
CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CMAKE_PREFIX_PATH="$ROOT/.devprefix" \
  timeout 300 python3 -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
rc=$?
grep -h -- "-- zeroshard" "$OUT/build.log"
say "build rc=$rc"
if [ $rc -ne 0 ]; then tail -30 "$OUT/build.log"; exit $rc; fi

say "cuda tests"
timeout 240 python3 -m pytest -q -n 8 -m cuda -p no:cacheprovider tests/python >"$OUT/cuda_tests.log" 2>&1
say "cuda tests rc=$?: $(tail -1 "$OUT/cuda_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.log" | head -20

say "ctest"
timeout 120 ctest --test-dir build -j "$(nproc)" >"$OUT/ctest.log" 2>&1
say "ctest rc=$?: $(grep 'tests passed' "$OUT/ctest.log")"

if [ "${1:-}" = "--no-bench" ]; then say "done (--no-bench)"; exit 0; fi

# DeepSpeed for bench/pipeline.py's --deepspeed-venv: a python that sees the wheels beside torch,
# in a folder of its own made fresh (never written through an existing venv's python symlink).
DS=/tmp/zeroshard-gpu-check-deepspeed
rm -rf "$DS" && mkdir -p "$DS/bin"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$DS/site" .whl/*.whl >"$OUT/ds_install.log" 2>&1
printf '#!/bin/sh\nPYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}%s/site" exec %s "$@"\n' "$DS" "$(command -v python3)" \
  >"$DS/bin/python"
chmod +x "$DS/bin/python"

# The two pipeline runs side by side (2 + 4 single-threaded ranks on 16 cores), each pairing its
# frameworks within a round.
# The bench prints its table only at its end: it gets what is left of BUDGET_S (the device call's limit).
left=$(( ${BUDGET_S:-570} - ($(date +%s) - start) - 20 ))
say "pipeline bench (2 and 4 stages, together), ${left} s left"
if [ "$left" -lt 60 ]; then say "too little time left for the bench"; exit 1; fi
CUDA_VISIBLE_DEVICES= timeout -k 20 "$left" python3 bench/pipeline.py --stages 2 --rounds 3 --deepspeed-venv "$DS" \
  >"$OUT/pipeline_2stages.txt" 2>&1 &
two=$!
CUDA_VISIBLE_DEVICES= timeout -k 20 "$left" python3 bench/pipeline.py --stages 4 --rounds 2 --deepspeed-venv "$DS" \
  >"$OUT/pipeline_4stages.txt" 2>&1 &
four=$!
wait $two; say "2 stages rc=$?"
wait $four; say "4 stages rc=$?"
for f in pipeline_2stages pipeline_4stages; do
  echo "== $f"; sed -n '/^GPT:/,$p' "$OUT/$f.txt" | grep -v "^theory:" | cut -c1-200
done
say "done"
