# Two commands set everything up and run: `make train` and `make test`.
# Both install what is missing (Debian packages, the .venv, the editable
# package) and are safe to repeat.
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := libstarpu-dev libopenblas-dev pkg-config
STAMP := $(VENV)/.jnntile-installed
NATIVE_SOURCES := $(shell find xla_ffi -name '*.cc' -o -name '*.h') CMakeLists.txt pyproject.toml

.PHONY: setup system-packages build train test bench bench-memory clean

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
	touch $(STAMP)

build: $(STAMP)

train: $(STAMP)
	$(PY) -m jnntile.train

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/gemm.py
	$(PY) bench/overhead.py
	$(PY) bench/train.py

# Training beyond RAM: memory limit, swap traffic, capacity (about 10 minutes on 2 cores).
bench-memory: $(STAMP)
	$(PY) bench/memory.py

clean:
	rm -rf build $(VENV)
