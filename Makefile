# The two commands of the README: `make demo` (main job) and `make test`.
# Each installs what it needs first, idempotently (scripts/setup).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench bench-compare bench-clean check clean

setup:
	bash scripts/setup

demo: setup
	$(VENV)/bin/stallwatch lab demo

# lint, types and the import contract first (scripts/check), then the suite
test: setup
	bash scripts/check
	$(PY) -m pytest

bench: setup
	$(PY) -m bench

# the big incidents' dumps (tens of GB) are kept in a cache folder between
# runs; this removes them
bench-clean:
	$(PY) -m bench.bench_analyzer --clean-cache

# the benchmarks with torch installed, so that torchfrtrace (torch's Flight
# Recorder analyzer) is measured beside ours on the same files
bench-compare: setup
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m bench

check: setup
	bash scripts/check

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
