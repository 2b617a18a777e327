# Two commands set everything up and run: `make train` and `make test`.
# Both install what is missing (Debian packages, the .venv, the editable
# package) and are safe to repeat. `make cuda` / `make test-gpu` do the same
# for the GPU build (StarPU with CUDA from source, .venv-cuda).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := libstarpu-dev libopenblas-dev pkg-config openmpi-bin libopenmpi-dev
STAMP := $(VENV)/.jnntile-installed
NATIVE_SOURCES := $(shell find xla_ffi -name '*.cc' -o -name '*.h' -o -name '*.cu') CMakeLists.txt pyproject.toml
# What the package and its tests import; the GPU machines have them preinstalled.
PYTHON_DEPS := jax flax optax numpy safetensors tokenizers jinja2 tqdm matplotlib pytest nanobind scikit-build-core cmake ninja

.PHONY: setup system-packages build train test bench bench-torch bench-memory cuda cuda-python-deps test-gpu \
	emulated-gpu test-emulated-gpu clean FORCE

setup: $(STAMP)

system-packages:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Build requirements are installed into the venv so rebuilds need no isolation.
$(STAMP): $(PY) $(NATIVE_SOURCES) | system-packages
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10" cmake ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# oneMKL on Intel CPUs: faster float32 products than OpenBLAS, and bfloat16 ones on AMX (jnntile/core/_blas.py).
	if grep -q GenuineIntel /proc/cpuinfo; then $(PY) -m pip install -q mkl; fi
	touch $(STAMP)

build: $(STAMP)

train: $(STAMP)
	$(PY) -m jnntile.train --overwrite  # each time afresh in out/

# When a test run dies (a crash in native code), its last lines are pytest's own frames: this prints the
# crash's message and the frames of this project (the test that ran) at the end, where a CI log shows them.
# --capture=sys: pytest captures Python's output only, so what native code writes (an assertion, StarPU's
# messages) reaches the log even when the process dies before pytest could show a captured file.
CRASH_SUMMARY = { if grep -q "Fatal Python error" $(1); then echo "--- the crash, this project's frames:"; \
	grep -B8 -A80 -m1 "Fatal Python error" $(1) | grep -v "site-packages\|<frozen" | head -40; fi; exit 1; }

test: $(STAMP)
	set -o pipefail; $(PY) -m pytest -q --capture=sys tests 2>&1 | tee $(VENV)/test.log || $(call CRASH_SUMMARY,$(VENV)/test.log)

bench: $(STAMP)
	$(PY) bench/gemm.py
	$(PY) bench/overhead.py
	$(PY) bench/train_step.py

# The training-step table with PyTorch's column: torch's CPU build and transformers in an environment of their
# own (never a dependency of jnntile). TORCH names the wheel: torch==2.13.0 is the CPU build some machines hold;
# elsewhere give a CPU wheel's index, e.g. TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
TORCH_VENV := .venv-torch
TORCH ?= torch==2.13.0
bench-torch: $(STAMP)
	test -x $(TORCH_VENV)/bin/python || python3 -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install -q $(TORCH) transformers
	$(PY) bench/train_step.py --torch-python $(TORCH_VENV)/bin/python

# Training beyond RAM: memory limit, swap traffic, capacity (about 10 minutes on 2 cores).
bench-memory: $(STAMP)
	$(PY) bench/memory.py

# ---- GPU build ------------------------------------------------------------------------------
# StarPU with CUDA from the pinned source (STARPU_SOURCE=tarball where there is
# no network) into .cuda/, then this package with its CUDA kernels into
# .venv-cuda. .venv-cuda sees the packages of the python3 that made it (a GPU
# machine's preinstalled JAX with its CUDA plugin); what is missing comes from PyPI.
CUDA_DIR := .cuda
CUDA_VENV := .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_STAMP := $(CUDA_VENV)/.jnntile-installed
GPU_OUT ?= out/gpu

cuda: $(CUDA_STAMP)

# Run each time: the script rebuilds StarPU only when its stamp (the commit, the toolkit, the patches and
# configure's arguments, which depend on whether an MPI is installed) changed, and leaves the stamp as it is otherwise.
$(CUDA_DIR)/starpu.stamp: FORCE
	tools/build_starpu_cuda.sh

$(CUDA_PY):
	python3 -m venv --system-site-packages $(CUDA_VENV)
	python3 -c "import site, sys; sys.prefix != sys.base_prefix and print('\n'.join(site.getsitepackages()))" \
	  > $$(echo $(CUDA_VENV)/lib/python3*/site-packages)/_jnntile_parent_site.pth

cuda-python-deps: $(CUDA_PY)
	@missing=$$($(CUDA_PY) tools/missing_modules.py $(PYTHON_DEPS)); \
	if [ -n "$$missing" ]; then echo "Installing into $(CUDA_VENV):$$missing"; \
	  $(CUDA_PY) -m pip install -q $$missing || { echo "could not install$$missing (no network?)"; exit 1; }; fi

$(CUDA_STAMP): $(CUDA_DIR)/starpu.stamp $(NATIVE_SOURCES) | cuda-python-deps
	PKG_CONFIG_PATH=$(abspath $(CUDA_DIR))/starpu/lib/pkgconfig $(CUDA_PY) -m pip install -q --no-build-isolation \
	  --no-deps -e . -C build-dir=build/cuda-{wheel_tag} -C cmake.define.CUDAToolkit_ROOT=$(abspath $(CUDA_DIR))/toolkit \
	  -C cmake.define.CMAKE_CUDA_COMPILER=$(abspath $(CUDA_DIR))/toolkit/bin/nvcc
	touch $(CUDA_STAMP)

# The whole test suite against the CUDA build (GPU tests skip without a GPU),
# then bench/gpu.py: a log and one JSON report in $(GPU_OUT). Both take longer
# than one 10-minute command on a GPU machine: a short lease runs parts, e.g.
#   make test-gpu GPU_TESTS="tests/test_gpu.py tests/test_attention.py" GPU_BENCH="--only train_bf16"
GPU_TESTS ?= tests
GPU_BENCH ?=
test-gpu: cuda
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(CUDA_PY) -m pytest -q -rs --capture=sys $(GPU_TESTS) 2>&1 | tee $(GPU_OUT)/test-gpu.log \
	  || $(call CRASH_SUMMARY,$(GPU_OUT)/test-gpu.log)
	set -o pipefail; $(CUDA_PY) bench/gpu.py --out $(GPU_OUT)/report.json $(GPU_BENCH) 2>&1 \
	  | tee -a $(GPU_OUT)/test-gpu.log

# The CUDA build on an emulated GPU, for machines without one (tools/emulated_gpu/emulated_gpu.c): StarPU's CUDA
# worker, GPU memory limits, eviction and transfers run for real, on host memory, with the CPU kernels.
EMULATED_GPU := $(CUDA_DIR)/libemulated_gpu.so
EMULATED_GPU_TESTS ?= tests/test_emulated_gpu.py tests/test_gpu.py tests/test_optim.py tests/test_grad_accumulation.py \
  tests/test_runtime.py
# Then on two emulated GPUs (EMULATED_GPU_COUNT): the training steps whose tests run on CUDA workers too.
EMULATED_TWO_GPU_TESTS ?= tests/test_optim.py tests/test_grad_accumulation.py
$(EMULATED_GPU): tools/emulated_gpu/emulated_gpu.c $(CUDA_DIR)/starpu.stamp
	cc -O2 -Wall -Wextra -shared -fPIC -I$(CUDA_DIR)/toolkit/targets/x86_64-linux/include -o $@ $< -lpthread

emulated-gpu: cuda $(EMULATED_GPU)

# Copies complete 20 us after they are queued, as a GPU's do later than their call (EMULATED_GPU_ASYNC_US).
# tests/test_emulated_gpu.py also trains on 2 ranks under mpirun, each with an emulated GPU: data parallel and
# sharded (about 2 minutes on 2 busy cores, both together).
test-emulated-gpu: emulated-gpu
	set -o pipefail; EMULATED_GPU_ASYNC_US=20 LD_PRELOAD=$(abspath $(EMULATED_GPU)) $(CUDA_PY) -m pytest -q -rs --capture=sys \
	  $(EMULATED_GPU_TESTS) 2>&1 | tee $(CUDA_VENV)/test-emulated-gpu.log || $(call CRASH_SUMMARY,$(CUDA_VENV)/test-emulated-gpu.log)
	set -o pipefail; EMULATED_GPU_COUNT=2 EMULATED_GPU_ASYNC_US=20 LD_PRELOAD=$(abspath $(EMULATED_GPU)) \
	  $(CUDA_PY) -m pytest -q -rs --capture=sys $(EMULATED_TWO_GPU_TESTS) 2>&1 | tee $(CUDA_VENV)/test-emulated-2gpu.log \
	  || $(call CRASH_SUMMARY,$(CUDA_VENV)/test-emulated-2gpu.log)

clean:
	rm -rf build $(VENV) $(CUDA_VENV) $(CUDA_DIR)
