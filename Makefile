# The two commands a newcomer needs: `make demo` and `make test`.
# Each sets up .venv (PyTorch pinned to the CPU build first, then this package) idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dlm-installed
TORCH  := torch==2.13.0
DFLASH := dflash==0.1.0

.PHONY: setup demo test test-all mutate bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dlm needs Python 3.11+")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	# z-lab's DFlash reference (the parity tests run it): its own requirements pin an older transformers, and its
	# model code needs only torch and transformers, so it is installed without them
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(DFLASH)
	@$(PY) -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dlm demo

test: setup
	$(PY) -m pytest -q -n 2 --dist worksteal

test-all: setup
	$(PY) -m pytest -q -m ''

# Mutation testing (docs/testing.md): mutmut mutates the functions below, one change at a time, and runs
# the fast tests that reach each; a mutant that no test fails is a survivor. Settings: [tool.mutmut].
MUTANTS := 'dlm.sampling.speculative.x_verify_*' 'dlm.sampling.common.x_entropy_bound_accept__*' \
	'dlm.sampling.mdlm.x_select_*' 'dlm.sampling.mdlm.x_top_k_of__*' 'dlm.sampling.usdm.x_renoise__*' \
	'dlm.sampling.usdm.x_should_stop__*' 'dlm.sampling.usdm.x_temperature__*' 'dlm.objectives.ar.*' \
	'dlm.objectives.mdlm.xǁMDLMǁloss__*' 'dlm.objectives.usdm.xǁUSDMǁloss__*' \
	'dlm.objectives.usdm.x_uniform_elbo_integrand__*' 'dlm.objectives.dflash.xǁDFlashǁloss__*'

mutate: setup
	$(PY) -m pip install -q --disable-pip-version-check -e '.[mutate]'
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $(or $(JOBS),2) $(MUTANTS)
	$(VENV)/bin/mutmut results

bench: setup
	$(VENV)/bin/dlm bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info mutants
