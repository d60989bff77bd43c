# The two commands of README.md: `make demo` and `make test`. Each creates and
# fills .venv when it is missing. torch is pinned to 2.13.0 when none is there
# (a CPU build on our machines), so no multi-GB CUDA build is ever pulled in.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format proto

$(BIN)/expertd: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

demo: $(BIN)/expertd
	$(BIN)/expertd demo $(ARGS)

test: $(BIN)/expertd lint
	$(BIN)/pytest -q $(ARGS)

lint: $(BIN)/expertd
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/expertd
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: $(BIN)/expertd
	scripts/gen_proto.sh
