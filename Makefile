# Two entry points (README): `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxtrain-installed

.PHONY: demo test test-long bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fxtrain demo

# Two workers: most of the suite is dynamo compiling Python on one core (tests/conftest.py gives each
# worker one intra-op thread, so two workers use the two cores without oversubscribing them).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not extended"

# The rest of the suite (tests marked `extended`: more models, sides and fuzzer seeds of paths
# `make test` covers once). Run before landing a change to what they cover.
test-long: $(STAMP)
	$(PY) -m pytest -q -n 2 -m extended

bench: $(STAMP)
	$(VENV)/bin/fxtrain bench

clean:
	rm -rf $(VENV) build *.egg-info
