# `make demo` and `make test` work on a fresh machine: each creates .venv, installs
# torch==2.13.0 first (a bare `torch` requirement could pull a multi-GB CUDA build),
# then this package with the extras it needs. The demo needs only hf and plot
# (.venv/.demo: `sdpa demo` runs MiniLM through transformers and draws with matplotlib);
# the suite needs every development extra on top (.venv/.dev; triton: the tests run the
# statistics kernels under its interpreter; the wheel installs in seconds). pip leaves the
# byte-compiling to the first import (--no-compile): compiling every file of torch and the
# extras up front took half of the demo's install time, and most are never imported.
# kvpress 0.5 pins transformers < 5.3, below the suite's: its tests and benchmark run in
# a second environment, .venv-kvpress, made the same way (torch first), then kvpress
# with its own pins, this package and pytest, nothing else.
# The torch matrix: the declared floor (pyproject's torch>=2.13) and the newest torch pip
# resolves here (the constraint file's cap) each run the core suite: tests/ minus the files
# listed, with the reason, in tests/torch_matrix.txt, in an environment of their own
# (.venv-torch-floor, -newest: torch first, then this package's dev extra, numpy, and the
# setuptools pyproject builds with, for test_packaging's offline wheel). The newest is
# PyPI's CUDA build (download.pytorch.org's CPU wheels are out of reach): 5.6 GB with its
# nvidia wheels. While the floor is the pinned torch, the pinned suite is the floor's run.
# `make test` runs the matrix after the pinned suite.
# pytest-xdist runs each suite in PYTEST_WORKERS processes (one per core of the 2-core
# machine CI runs on; tests/conftest.py gives each worker its share of the threads): about
# 10 minutes for the pinned suite where one process takes 14, as a third of it waits on
# the subprocesses it starts (the command, examples, ring ranks).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.13.0
KVENV := .venv-kvpress
KVPY := $(KVENV)/bin/python
KVPIP := $(KVPY) -m pip --disable-pip-version-check -q
TORCH_floor := 2.13.0
TORCH_newest := 2.14.1
PYTEST_WORKERS ?= 2
# (a floor equal to the pinned torch is the pinned suite's: the matrix adds the newest only)
MATRIX := $(if $(filter torch==$(TORCH_floor),$(TORCH)),,floor) newest
MATRIX_PYTEST := -x -q -p no:cacheprovider -n $(PYTEST_WORKERS)
MATRIX_EXCLUDED := $(addprefix tests/,$(shell sed -e 's/\#.*//' tests/torch_matrix.txt | awk '{print $$1}'))
MATRIX_TESTS := $(filter-out $(MATRIX_EXCLUDED),$(sort $(wildcard tests/test_*.py)))

.PHONY: demo test test-torch-matrix test-torch-floor test-torch-newest lint bench clean chromium docs

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile $(TORCH)
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PIP) install --no-compile -e '.[hf,plot]'
	touch $@

$(VENV)/.dev: $(VENV)/.demo pyproject.toml
	$(PIP) install --no-compile -e '.[dev,plot,hf,gpu,viewers,diffusers,browser,docs,interp]'
	touch $@

$(KVENV)/.torch:
	$(PYTHON) -m venv $(KVENV)
	$(KVPIP) install $(TORCH)
	touch $@

$(KVENV)/.kvpress: $(KVENV)/.torch pyproject.toml
	$(KVPIP) install -e '.[kvpress]' 'pytest>=8'
	touch $@

# One environment per torch of the matrix ($(1): floor or newest), made afresh when its
# version changes; it ignores itself (git leaves it alone without a .gitignore line).
define matrix_torch
	rm -rf .venv-torch-$(1)
	$(PYTHON) -m venv .venv-torch-$(1)
	echo '*' > .venv-torch-$(1)/.gitignore
	.venv-torch-$(1)/bin/python -m pip --disable-pip-version-check -q install torch==$(TORCH_$(1))
	touch $@
endef

define matrix_dev
	.venv-torch-$(1)/bin/python -m pip --disable-pip-version-check -q install -e '.[dev]' numpy \
		'setuptools>=68'
	touch $@
endef

# The core suite on one torch of the matrix: stops at the first failure, writes no cache
# (make test-torch-matrix MATRIX_PYTEST=-q runs every test).
define matrix_run
	@.venv-torch-$(1)/bin/python -c "import torch; print('torch', torch.__version__)"
	HF_HUB_OFFLINE=1 .venv-torch-$(1)/bin/python -m pytest $(MATRIX_PYTEST) $(MATRIX_TESTS)
endef

.venv-torch-floor/.torch-$(TORCH_floor):
	$(call matrix_torch,floor)

.venv-torch-floor/.dev: .venv-torch-floor/.torch-$(TORCH_floor) pyproject.toml
	$(call matrix_dev,floor)

test-torch-floor: .venv-torch-floor/.dev
	$(call matrix_run,floor)

.venv-torch-newest/.torch-$(TORCH_newest):
	$(call matrix_torch,newest)

.venv-torch-newest/.dev: .venv-torch-newest/.torch-$(TORCH_newest) pyproject.toml
	$(call matrix_dev,newest)

test-torch-newest: .venv-torch-newest/.dev
	$(call matrix_run,newest)

test-torch-matrix: $(MATRIX:%=test-torch-%)

# The browser tests (`sdpa view`) drive Debian's Chromium: installed here when missing and
# we can (root with apt-get); otherwise they skip, saying how to get it.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q chromium >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } \
		|| echo "make: chromium not installed (sudo apt-get install chromium): the browser tests will skip"

demo: $(VENV)/.demo
	HF_HUB_OFFLINE=1 $(PY) -m sdpa demo

test: $(VENV)/.dev $(KVENV)/.kvpress chromium
	$(PY) -m ruff check src tests benchmarks scripts
	$(PY) -m ruff format --check src tests benchmarks scripts
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS)
	HF_HUB_OFFLINE=1 $(KVPY) -m pytest -q -m kvpress tests/test_kvpress.py
	$(MAKE) test-torch-matrix

# The guides and the API reference (mkdocs + mkdocstrings), offline, into site/; warnings
# (a broken link or anchor, a page out of the nav) are errors, and so is a benchmark table
# that differs from benchmarks/results (regenerate: python scripts/bench_tables.py).
docs: $(VENV)/.dev
	$(PY) scripts/bench_tables.py --check
	$(PY) -m mkdocs build --strict --site-dir site

lint: $(VENV)/.dev
	$(PY) -m ruff check src tests benchmarks scripts
	$(PY) -m ruff format --check src tests benchmarks scripts

bench: $(VENV)/.dev $(KVENV)/.kvpress
	$(PY) benchmarks/bench_core.py --json benchmarks/results/core.json
	$(PY) benchmarks/bench_modules.py --json benchmarks/results/modules.json
	$(PY) benchmarks/bench_weights.py --json benchmarks/results/weights.json
	$(PY) benchmarks/bench_masks.py --json benchmarks/results/masks.json
	$(PY) benchmarks/bench_score_mods.py --json benchmarks/results/score_mods.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_hf.py --json benchmarks/results/hf.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_decode.py --json benchmarks/results/decode.json
	$(PY) benchmarks/bench_ring.py --schemes ring --heads 4 --json benchmarks/results/ring.json
	$(PY) benchmarks/bench_ring.py --length 16384 --ranks 8 --json benchmarks/results/ring_schemes.json
	$(PY) benchmarks/bench_diffusers.py --json benchmarks/results/diffusers.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_view.py --json benchmarks/results/view.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_interp.py --json benchmarks/results/interp.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_train.py --json benchmarks/results/train.json
	HF_HUB_OFFLINE=1 $(KVPY) benchmarks/bench_kvpress.py --json benchmarks/results/kvpress.json

clean:
	rm -rf $(VENV) $(KVENV) .venv-torch-floor .venv-torch-newest build src/*.egg-info .pytest_cache .ruff_cache
