# `make demo` and `make test` work on a fresh machine: each creates .venv, installs
# torch==2.13.0 first (a bare `torch` requirement could pull a multi-GB CUDA build),
# then this package with the extras it needs (triton: the test suite runs the statistics
# kernels under its interpreter; the wheel installs in seconds).
# kvpress 0.5 pins transformers < 5.3, below the suite's: its tests and benchmark run in
# a second environment, .venv-kvpress, made the same way (torch first), then kvpress
# with its own pins, this package and pytest, nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.13.0
KVENV := .venv-kvpress
KVPY := $(KVENV)/bin/python
KVPIP := $(KVPY) -m pip --disable-pip-version-check -q

.PHONY: demo test lint bench clean chromium docs

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[dev,plot,hf,gpu,viewers,diffusers,browser,docs,interp]'
	touch $@

$(KVENV)/.torch:
	$(PYTHON) -m venv $(KVENV)
	$(KVPIP) install $(TORCH)
	touch $@

$(KVENV)/.kvpress: $(KVENV)/.torch pyproject.toml
	$(KVPIP) install -e '.[kvpress]' 'pytest>=8'
	touch $@

# The browser tests (`sdpa view`) drive Debian's Chromium: installed here when missing and
# we can (root with apt-get); otherwise they skip, saying how to get it.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q chromium >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } \
		|| echo "make: chromium not installed (sudo apt-get install chromium): the browser tests will skip"

demo: $(VENV)/.dev
	HF_HUB_OFFLINE=1 $(PY) -m sdpa demo

test: $(VENV)/.dev $(KVENV)/.kvpress chromium
	$(PY) -m ruff check src tests benchmarks scripts
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q
	HF_HUB_OFFLINE=1 $(KVPY) -m pytest -q -m kvpress tests/test_kvpress.py

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
	$(PY) benchmarks/bench_ring.py --json benchmarks/results/ring.json
	$(PY) benchmarks/bench_diffusers.py --json benchmarks/results/diffusers.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_view.py --json benchmarks/results/view.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_interp.py --json benchmarks/results/interp.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_train.py --json benchmarks/results/train.json
	HF_HUB_OFFLINE=1 $(KVPY) benchmarks/bench_kvpress.py --json benchmarks/results/kvpress.json

clean:
	rm -rf $(VENV) $(KVENV) build src/*.egg-info .pytest_cache .ruff_cache
