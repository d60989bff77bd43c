# The two commands of README.md: `make demo` and `make test`. Each creates and
# fills .venv when it is missing, saying what it installs. When .venv has no
# torch, torch 2.13.0 is installed (our package index resolves it to the CPU
# build); install the torch you want into .venv first (a CUDA build for a GPU)
# and it is kept.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format proto

$(BIN)/expertd: pyproject.toml
	@test -x $(BIN)/python || { echo "== creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
	  echo "== installing torch 2.13.0 into $(VENV) (none there; for a GPU, install a CUDA torch first)"; \
	  $(BIN)/pip install torch==2.13.0; }
	@echo "== installing expertd (editable) and its test tools into $(VENV)"
	$(BIN)/pip install -e '.[dev]'
	@echo "== $(VENV) ready"
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
