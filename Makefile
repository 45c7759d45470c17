# The two commands a newcomer needs: `make demo` and `make test`.
# Each sets up .venv (PyTorch pinned to the CPU build first, then this package) idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dlm-installed
TORCH  := torch==2.13.0

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dlm needs Python 3.11+")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@$(PY) -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dlm demo

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

bench: setup
	$(VENV)/bin/dlm bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
