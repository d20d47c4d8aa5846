# The two commands of the README: `make demo` (main job) and `make test`.
# Each installs what it needs first, idempotently (scripts/setup).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-latest lock bench bench-compare bench-clean soak check clean

setup:
	bash scripts/setup

demo: setup
	$(VENV)/bin/stallwatch lab demo

# lint, types and the import contract first (scripts/check), then the suite:
# on parallel workers (each test file on one worker: its recordings are made
# once), then the tests that judge timing alone (marker solo)
WORKERS ?= 4
SUITE = -m "not solo" -n $(WORKERS) --dist loadfile
# the slowest tests of each phase are listed at its end: where the time goes
DURATIONS = --durations=15
test: setup
	bash scripts/check
	$(PY) -m pytest $(SUITE) $(DURATIONS)
	$(PY) -m pytest -m solo $(DURATIONS)

# the suite on the newest versions pyproject's ranges allow, in a venv of its
# own (.venv-latest): upgrading is then `make lock` and its own commit
test-latest:
	VENV=.venv-latest STALLWATCH_LOCK= STALLWATCH_LINK= bash scripts/setup
	VENV=.venv-latest bash scripts/check
	.venv-latest/bin/python -m pytest $(SUITE)
	.venv-latest/bin/python -m pytest -m solo

# the lock of tested versions that scripts/setup installs from, re-resolved
# from pyproject's ranges (commit it with the suite's result on it)
# (with pip's wheel cache, PIP_FIND_LINKS, where torch's CPU build lies)
lock: setup
	$(VENV)/bin/uv pip compile --quiet --upgrade pyproject.toml --extra test --extra dev \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--custom-compile-command "make lock" -o requirements/lock.txt

bench: setup
	$(PY) -m bench

# the agent under a steady load for 30 minutes (memory flat, nothing lost);
# light enough to run beside other work
soak: setup
	$(PY) -m bench.bench_soak

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
	rm -rf build $(VENV) .venv-latest .pytest_cache .mypy_cache .ruff_cache
