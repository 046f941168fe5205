# Two entry points (README): `make demo` and `make test`. Both create a venv on first use.
#
# TORCH picks the torch release of the tested window, one venv each (.venv/torch-<version>), with
# the exact versions of constraints/torch-<version>.txt, so `make test` means the same everywhere:
#   make test                 # torch 2.13.0: its CPU wheel lies on this machine's disk (fast set-up)
#   make test TORCH=2.11.0    # the oldest release (with transformers 5.17, as on the GPU image)
#   make test TORCH=2.14.1    # the newest
#   make test TORCH=2.11.0 PYTHON=python3.12   # another interpreter (its own venv: .venv/python3.12-torch-2.11.0)
# .ci/run tests both ends of the window.
TORCH ?= 2.13.0
PYTHON ?= python3
VENV ?= .venv/$(if $(filter python3,$(PYTHON)),,$(notdir $(PYTHON))-)torch-$(TORCH)
PY := $(VENV)/bin/python
CONSTRAINTS := constraints/torch-$(TORCH).txt
STAMP := $(VENV)/.fxtrain-installed

.PHONY: demo test test-long bench clean

$(CONSTRAINTS):
	@echo "make: no constraints/torch-$(TORCH).txt; tested releases: $(patsubst constraints/torch-%.txt,%,$(wildcard constraints/torch-*.txt))" >&2
	@exit 2

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fxtrain demo

# Two workers: most of the suite is dynamo compiling Python on one core (tests/conftest.py gives each
# worker one intra-op thread, so two workers use the two cores without oversubscribing them).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not extended"

# The rest of the suite (tests marked `extended`: more models, sides and fuzzer seeds of paths
# `make test` covers once). Run before landing a change to what they cover. Then the device audit of
# every test (tests/conftest.py, --device-audit; 47 s on 2 cores): each one puts its model and batches
# on FXTRAIN_TEST_DEVICE or says why it is cpu_only. It needs a torch without CUDA, as here and in CI.
test-long: $(STAMP)
	$(PY) -m pytest -q -n 2 -m extended
	@if $(PY) -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then \
		FXTRAIN_TEST_DEVICE=cuda $(PY) -m pytest -q -n 2 -p no:cacheprovider --device-audit; \
	else echo "make test-long: this torch reaches CUDA, so no device audit: run FXTRAIN_TEST_DEVICE=cuda make test"; fi

bench: $(STAMP)
	$(VENV)/bin/fxtrain bench

clean:
	rm -rf .venv build *.egg-info
