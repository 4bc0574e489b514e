# kcla_mm: `make demo` and `make test` each set up .venv/ first (idempotent;
# the mmcv wheel is cached, so only the first run builds it).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-seg test test-fast

setup:
	PYTHON=$(PYTHON) bash tools/setup_env.sh

demo: setup
	$(PY) tools/demo.py

demo-seg: setup
	$(PY) tools/seg_demo.py

# passing tests' tmp_path folders (checkpoints, work dirs) are removed as
# they finish, so a run needs little disk
PYTEST := $(PY) -m pytest tests -ra -o tmp_path_retention_policy=failed

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"
