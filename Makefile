# The two commands of the README: `make demo` (main job) and `make test`.
# Each installs what it needs first, idempotently (scripts/setup).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench check clean

setup:
	bash scripts/setup

demo: setup
	$(VENV)/bin/stallwatch lab demo

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) -m bench

check: setup
	bash scripts/check

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
