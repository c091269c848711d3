# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the suite.
# Each installs what it needs (a virtual environment in .venv) by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test integration lint bench soak install clean env-doc process-replay process-replay-update differential-long

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tinydist demo

# ruff and mypy read their settings from pyproject.toml ([tool.ruff], [tool.mypy]); both must be clean.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# Tests marked `integration` (pyproject's addopts leaves them out of `make test`): two hosts in network
# namespaces (tests/cluster/test_two_hosts.py), a one-host Slurm running deploy/slurm/train.sbatch
# (tests/cluster/test_slurm.py), ... First, as root, the Debian packages they need
# (deploy/ci/apt-packages.txt, one per line) that are missing are installed with apt-get
# (deploy/ci/install-packages.sh); not root, nothing is installed and the tests skip, -rs printing why.
integration: $(STAMP)
	sh deploy/ci/install-packages.sh
	$(BIN)/python -m pytest -q -rs -m integration

# The schedules and LLVM IR of a fixed graph corpus, against the goldens in tests/schedule/process_replay/.
process-replay: $(STAMP)
	$(BIN)/python -m pytest -q tests/schedule/test_process_replay.py

# Rewrite every golden (after a change meant to alter schedules or IR): review and commit the diff.
process-replay-update: $(STAMP)
	$(BIN)/python -m tests.schedule.process_replay_update

# The JIT differential test with thousands of fresh random programs instead of CI's fixed set
# (tests/jit/test_differential.py); a failure prints its program and a @reproduce_failure blob.
differential-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q -o timeout=0 -o faulthandler_timeout=0 tests/jit/test_differential.py -k every_replay

soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes 30

bench: $(STAMP)
	$(BIN)/python bench/runtime.py

env-doc: $(STAMP)
	$(BIN)/python -c "from tinydist.base.config import env_vars_markdown; print(env_vars_markdown(), end='')" > docs/env_vars.md

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
