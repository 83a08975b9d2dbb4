# The two README commands: `make demo` (train the tiny LM on CPU) and `make test`.
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   := data/stdlib

.PHONY: setup setup-dev demo test lint prepare tensorboard clean

# setup: what the demo needs (the runtime); setup-dev adds the test and lint tools (pytest, ruff, transformers,
# a DeepSpeed sdist build), which only `make test` and `make lint` use.
setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

# CPU-only machines take torch 2.13.0 (a CPU build; installed first, it satisfies the project's
# torch range, so pip never pulls a multi-GB CUDA build). Machines with an NVIDIA driver get the
# normal CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet torch; \
	else \
		$(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

$(DATA)/meta.json: | setup
	$(BIN)/lmledger prepare --source stdlib --out $(DATA)

prepare: $(DATA)/meta.json

demo: setup $(DATA)/meta.json
	$(BIN)/lmledger fit --config configs/tiny.yaml

# The suite on two pytest-xdist workers (whole files each; tests/conftest.py groups them), then the tests marked
# `alone`, which time the machine, with nothing beside them. --durations: the slowest of every run in its output,
# so the suite's budget (15 min on 2 cores) is watched. docs/development.md says why two workers.
WORKERS ?= 2
test: setup-dev
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not alone" --durations=40
	$(BIN)/python -m pytest -q -m alone --durations=10

lint: setup-dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

tensorboard: setup
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1

clean:
	rm -rf $(VENV) runs
