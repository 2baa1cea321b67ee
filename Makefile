# tierzero: `make train` and `make test` are the whole setup on a fresh machine.
# Each installs what is missing (PyTorch into a project-local virtualenv for tch), then runs.

TORCH_VERSION := 2.11.0
VENV          := $(CURDIR)/.venv
PYTHON        ?= python3
# tensorboard: its event reader checks the monitors' files in the tests
TENSORBOARD_VERSION := 2.21.0
TORCH_STAMP   := $(VENV)/.torch-$(TORCH_VERSION)-tb-$(TENSORBOARD_VERSION)
CONFIG        ?= configs/default.json
CARGO         ?= cargo

# torch-sys finds libtorch through LIBTORCH (the pip wheel's torch directory).
export LIBTORCH = $(shell ls -d $(VENV)/lib/python3*/site-packages/torch 2>/dev/null | head -n 1)
export LIBTORCH_BYPASS_VERSION_CHECK = 1

.PHONY: train test setup tools build lint unit bench-adam clean-venv gpu-bundle _gpu-bundle

setup: $(TORCH_STAMP) tools

# system tools the tests use: strace watches a checkpoint save's system calls from outside;
# the binary links gperftools' tcmalloc whole (build.rs), from libgoogle-perftools-dev
tools:
	@command -v strace >/dev/null || (apt-get update && apt-get install -y strace)
	@test -f /usr/lib/$$(gcc -dumpmachine)/libtcmalloc_minimal.a || (apt-get update && apt-get install -y libgoogle-perftools-dev)

$(TORCH_STAMP):
	@command -v $(PYTHON) >/dev/null || (apt-get update && apt-get install -y python3 python3-venv python3-pip)
	@test -x $(VENV)/bin/pip || $(PYTHON) -m venv $(VENV)
	@avail=$$(df -Pk $(CURDIR) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  test "$$avail" -ge 12 || echo "WARN $$avail GiB free under $(CURDIR): torch's wheels take ~8 GiB while they install and the build ~7 GiB more; free space if pip stops with 'No space left on device'"
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-cache-dir torch==$(TORCH_VERSION) tensorboard==$(TENSORBOARD_VERSION)
	@touch $@

build: setup
	$(MAKE) --no-print-directory LIBTORCH=$$(ls -d $(VENV)/lib/python3*/site-packages/torch) _build

_build:
	$(CARGO) build --release --bin tierzero

train: build
	./target/release/tierzero train --config $(CONFIG)

test: setup
	$(MAKE) --no-print-directory LIBTORCH=$$(ls -d $(VENV)/lib/python3*/site-packages/torch) _test

# every run in the tests uses checked lanes (random delays, NaN-poisoned pools) unless a
# test picks its lanes itself: a missing wait anywhere fails the suite
_test:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	TIERZERO_CHECKED_LANES=1 $(CARGO) test --workspace

bench-adam: build
	./target/release/tierzero bench adam --params 100000000

# What a GPU machine needs (no Rust there): the stripped release binary and the stripped
# integration-test binary, in target/gpu/ (README, "On a GPU").
gpu-bundle: setup
	$(MAKE) --no-print-directory LIBTORCH=$$(ls -d $(VENV)/lib/python3*/site-packages/torch) _gpu-bundle

_gpu-bundle:
	$(CARGO) build --release --bin tierzero
	mkdir -p target/gpu
	strip -o target/gpu/tierzero target/release/tierzero
	strip -o target/gpu/tests $$($(CARGO) test --release --test tests --no-run --message-format=json 2>/dev/null \
		| $(PYTHON) -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['name']=='tests'][-1])")
	ls -la target/gpu
