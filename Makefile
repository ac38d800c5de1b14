# `make run`: create .venv, install, train the default experiment offline.
# `make test`: create .venv if needed, install, run the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
ARGS   ?=

.PHONY: run test test-unit test-inproc test-cluster install bench clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/activate
	$(PY) -m pip install --quiet -e '.[$*]'
	touch $@

install: $(VENV)/.installed-test

run: $(VENV)/.installed-data
	$(VENV)/bin/hetps run $(CONFIG) $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(ARGS)

test-unit test-inproc test-cluster: test-%: $(VENV)/.installed-test
	$(PY) -m pytest -q -m $* $(ARGS)

bench: $(VENV)/.installed-test
	$(PY) bench/transport.py --sizes lenet,4K,64K,1M,16M,64M
	$(PY) bench/step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
