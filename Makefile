# `make run`: create .venv, install, train the default experiment offline.
# `make test`: create .venv if needed, install, run the whole suite: `ruff check` and mypy over
# proto/ (lint), the unit and inproc tiers (tests/unit, tests/inproc) on $(WORKERS) pytest-xdist
# processes, then the cluster tier (tests/cluster: real processes) on $(WORKERS) too, then the
# cluster tests marked `exclusive` (they compare timings or measured speeds) alone.
# `make format`: format the tree and apply ruff's safe fixes (imports sorted, ...).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
ARGS   ?=
WORKERS ?= 2
# bytecode caches are written (hetps' modules, and the tests' assertion-rewritten ones): where the
# environment forbids them, every pytest process and every `hetps` it starts compiles them again
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-unit test-inproc test-cluster lint format install bench clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# --no-compile: pip would compile every module of every package it installs (torch's thousands:
# ~75 s of a 160 s install on 2 cores); a module is compiled when first imported instead
$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/activate
	$(PY) -m pip install --quiet --no-compile -e '.[$*]'
	touch $@

install: $(VENV)/.installed-test

run: $(VENV)/.installed-data
	$(VENV)/bin/hetps run $(CONFIG) $(ARGS)

# every part runs even when one fails; exit status 5 (no test selected, e.g. ARGS names
# one file) is not a failure of a part
test: $(VENV)/.installed-test
	@status=0; \
	$(VENV)/bin/ruff check --quiet . || status=1; \
	$(VENV)/bin/mypy proto || status=1; \
	$(PY) -m pytest -q -n $(WORKERS) -m "not cluster" $(ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal --durations=10 -m "cluster and not exclusive" $(ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) -m pytest -q --durations=5 -m exclusive $(ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy proto

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test-unit test-inproc: test-%: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(WORKERS) -m $* $(ARGS)

test-cluster: $(VENV)/.installed-test
	@status=0; \
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "cluster and not exclusive" $(ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) -m pytest -q -m exclusive $(ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

# the ratios docs/results.md reports: round trips against raw pyzmq (socket, then shared memory for
# frames >= 256 KiB), step time against DDP-gloo, and one shard's updates against memory bandwidth
bench: $(VENV)/.installed-test
	$(PY) bench/transport.py --sizes lenet,4K,64K,1M,16M,64M
	$(PY) bench/transport.py --sizes 1M,64M --shm 262144
	$(PY) bench/step.py --models lenet5 --workers 1,2,4,8
	$(PY) bench/shard.py --rows lenet:4,lenet:64,1M:4,100M:2 --shm 262144

clean:
	rm -rf $(VENV) runs .pytest_cache
