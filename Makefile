# The two README commands: `make demo` (train the tiny LM on CPU) and `make test`.
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   := data/stdlib

.PHONY: setup demo test lint prepare tensorboard clean

setup: $(VENV)/.installed

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
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

$(DATA)/meta.json: | setup
	$(BIN)/lmledger prepare --source stdlib --out $(DATA)

prepare: $(DATA)/meta.json

demo: setup $(DATA)/meta.json
	$(BIN)/lmledger fit --config configs/tiny.yaml

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

tensorboard: setup
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1

clean:
	rm -rf $(VENV) runs
