# The two commands of README.md: `make demo` and `make test`. Each creates and
# fills .venv when it is missing, saying what it installs. torch goes in first,
# on its own, so expertd's install never picks one: when .venv has no torch,
# $(TORCH) is installed from TORCH_INDEX when set (e.g. PyTorch's CPU wheel
# index), else from the configured index (ours serves the CPU build; PyPI's
# Linux wheel is a CUDA build of several GB). Install the torch you want into
# .venv first (a CUDA build for a GPU) and it is kept.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test lint format proto

$(BIN)/expertd: pyproject.toml
	@test -x $(BIN)/python || { echo "== creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
	  echo "== installing $(TORCH) into $(VENV) (none there; for a GPU, install a CUDA torch first)"; \
	  $(BIN)/pip install '$(TORCH)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); }
	@$(BIN)/python -W ignore -c "import torch; print('== torch', torch.__version__, 'CUDA', torch.version.cuda or 'none')"
	@echo "== installing expertd (editable) with its server parts and test tools into $(VENV)"
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
