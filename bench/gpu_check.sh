#!/usr/bin/env bash
# The GPU machine's checks in one command, for the `device` tool's minutes on it (bench/RESULTS.md,
# "Second GPU run"):
#
#   build from source (CUDA kernels where nvcc matches torch) -> the `cuda` tests on 8 workers ->
#   ctest -> bench/pipeline.py at 4 stages, then at 2, with the peers, on the CPU cores (CUDA
#   hidden: multi-rank pipelines run on Gloo; NCCL needs a GPU per rank and the machine has one)
#
#   bench/gpu_check.sh [--no-bench | --no-tests]   BUDGET_S: seconds the whole script may take
#                                     (default 570), set under the device call's timeout_s
#
# That machine has torch, nvcc, cmake and ninja but no package registry. Made here, carried with
# the call (`carry: [".devprefix", ".whl"]`, both .gitignored):
#   .devprefix  the headers CMake needs, from Debian's nlohmann-json3-dev and catch2 (2.x):
#               include/{nlohmann,catch2}, share/cmake/nlohmann_json, lib/cmake/Catch2 and
#               lib/libCatch2WithMain.a copied from /usr
#   .whl        DeepSpeed and what it needs that the machine lacks, for Python 3.12:
#               DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl;
#               pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
#               manylinux2014_x86_64 -d .whl pydantic pydantic_core annotated-types typing-inspection hjson
#               (versions as in a DeepSpeed venv here)
#
# It installs the extension into that machine's python3 and rebuilds build/, so it refuses to run
# where nvidia-smi sees no GPU. Everything it prints also goes to $OUT/gpu_check.log; each part's
# log to $OUT/<part>.log (the device tool brings $OUT back).
set -u
MODE=${1:-}
case "$MODE" in
  ""|--no-bench|--no-tests) [ $# -le 1 ] || { echo "bench/gpu_check.sh: one option at most, got: $*" >&2; exit 2; } ;;
  *) echo "bench/gpu_check.sh: unknown option '$MODE'; expected none, --no-bench or --no-tests" >&2; exit 2 ;;
esac
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu_check.sh: no GPU here (nvidia-smi -L failed); it is for the GPU machine" >&2
  exit 2
fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
start=$(date +%s)
budget=${BUDGET_S:-570}
say() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }
status=0  # 1 once a test run, ctest or a bench fails or is skipped: the script's exit status
failed() { [ "$1" -eq 0 ] || status=1; }
# The seconds a part may take: its own cap, or what is left of the budget when that is less.
cap() { local left=$(( budget - ($(date +%s) - start) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }

say "machine: $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
say "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'); $(nvcc --version | tail -1)"

say "build"
CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CMAKE_PREFIX_PATH="$ROOT/.devprefix" \
  timeout "$(cap 300)" python3 -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
rc=$?
grep -h -- "-- zeroshard" "$OUT/build.log"
say "build rc=$rc"
if [ $rc -ne 0 ]; then tail -30 "$OUT/build.log"; exit $rc; fi

if [ "$MODE" != "--no-tests" ]; then
  say "cuda tests"
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist, where installed
  timeout "$(cap 240)" python3 -m pytest -q $workers -m cuda -p no:cacheprovider tests/python >"$OUT/cuda_tests.log" 2>&1
  rc=$?; failed $rc
  say "cuda tests rc=$rc: $(tail -1 "$OUT/cuda_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.log" | head -20

  say "ctest"
  timeout "$(cap 120)" ctest --test-dir build -j "$(nproc)" >"$OUT/ctest.log" 2>&1
  rc=$?; failed $rc
  say "ctest rc=$rc: $(grep 'tests passed' "$OUT/ctest.log")"

  if [ "$MODE" = "--no-bench" ]; then say "done (--no-bench)"; exit $status; fi
fi

# DeepSpeed for bench/pipeline.py's --deepspeed-venv: a python that sees the wheels beside torch,
# in a new folder (never written through an existing venv's python, which links to an interpreter).
DS=$(mktemp -d /tmp/gpu_check_deepspeed.XXXXXX)
mkdir -p "$DS/bin"
timeout "$(cap 60)" python3 -m pip install -q --no-index --no-deps --no-compile --target "$DS/site" .whl/*.whl \
  >"$OUT/ds_install.log" 2>&1 || say "DeepSpeed wheels did not install (ds_install.log): its column will say why"
printf '#!/bin/sh\nPYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}%s/site" exec "%s" "$@"\n' "$DS" "$(command -v python3)" \
  >"$DS/bin/python"
chmod +x "$DS/bin/python"

# The pipeline runs one after the other (one framework at a time, each pairing its frameworks
# within a round), so that they do not share the cores: 4 stages gets two thirds of what is left
# less 20 s, 2 stages the rest less 20 s; a SIGTERM then makes each print the runs that had
# finished. Rounds: as many as fit at about 210 s per 4-stage round (the third GPU run's, in
# bench/RESULTS.md) and, a guess not yet timed there, 120 s per 2-stage round; at least 1.
for stages in 4 2; do
  left=$(( $(cap 100000) - 20 ))
  [ "$stages" = 4 ] && left=$(( left * 2 / 3 ))
  say "pipeline bench, $stages stages, ${left} s for it"
  if [ "$left" -lt 60 ]; then say "too little time left for the $stages-stage bench"; status=1; continue; fi
  per_round=$([ "$stages" = 4 ] && echo 210 || echo 120)
  rounds=$(( left / per_round > 0 ? left / per_round : 1 ))
  CUDA_VISIBLE_DEVICES= timeout -k 20 "$left" python3 bench/pipeline.py --stages "$stages" --rounds "$rounds" \
    --deepspeed-venv "$DS" --dump "$OUT/pipeline_${stages}stages.json" >"$OUT/pipeline_${stages}stages.log" 2>&1
  rc=$?; failed $rc
  say "$stages stages rc=$rc ($rounds round(s) asked)"
  echo "== pipeline_${stages}stages"; sed -n '/^GPT:/,$p' "$OUT/pipeline_${stages}stages.log" | grep -v "^theory:" | cut -c1-220
done
say "done"
exit $status
