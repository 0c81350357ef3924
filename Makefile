# The README's two commands. Each does its own set-up on a fresh Debian 12 machine and skips the
# steps that are already satisfied.
PY        ?= python3
PIP       := $(PY) -m pip
APT_PKGS  := nlohmann-json3-dev catch2 ccache cmake g++ openssh-server openssh-client iproute2 procps liburing-dev libaio-dev fio nftables
NPROC     := $(shell nproc)
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(NPROC)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test build compat setup setup-system setup-python test-cpp test-python clean

demo: build
	$(PY) -m zeroshard.launcher.runner --num_gpus 2 examples/train_gpt.py --deepspeed_config configs/demo_zero.json

test: build
	$(MAKE) --no-print-directory test-cpp test-python

test-cpp:
	ctest --test-dir build --output-on-failure -j $(NPROC)

test-python:
	$(PY) -m pytest -q --durations=25 tests/python

# flock: one build at a time in the shared build/ folder.
build: setup
	flock /tmp/zeroshard-build.lock $(PIP) install -q --no-build-isolation --no-deps -c constraints.txt -e .

# Optional: the `deepspeed` compatibility distribution, for transformers / accelerate
# (docs/deepspeed-compat.md). It refuses to replace a real DeepSpeed.
compat: build
	$(PIP) install -q --no-deps ./compat/deepspeed

setup: setup-system setup-python

setup-system:
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

setup-python:
	@$(PY) -c "import torch, numpy, pytest, scikit_build_core, ninja, safetensors, transformers, accelerate, tensorboard, matplotlib, tqdm; assert torch.__version__.split('+')[0] == '2.11.0'; assert transformers.__version__ == '5.23.0' and accelerate.__version__ == '1.15.0'" 2>/dev/null || \
	  $(PIP) install -q -c constraints.txt torch numpy pytest scikit-build-core ninja safetensors transformers accelerate tensorboard matplotlib tqdm

clean:
	rm -rf build
