# Set-up and the two entry points the README names: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint install

install: $(STAMP)

# torch first, pinned to the CPU wheel, so the package's `torch>=2.6` is already met.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks tools
	$(VENV)/bin/mypy

# DeepSpeed builds its small ops once, into the venv
test: lint
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions \
		$(VENV)/bin/pytest -q --durations=25

# the tests that start no process (tests/_tiers.py marks the others), without lint: the
# daily tier, a couple of minutes on 2 cores; `make test` stays the whole suite (CI)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions \
		$(VENV)/bin/pytest -q -m "not processes and not long" --durations=10
