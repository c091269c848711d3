# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the suite.
# Each installs what it needs (a virtual environment in .venv) by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench install clean env-doc

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tinydist demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/runtime.py

env-doc: $(STAMP)
	$(BIN)/python -c "from tinydist.config import env_vars_markdown; print(env_vars_markdown(), end='')" > docs/env_vars.md

clean:
	rm -rf $(VENV) build *.egg-info
