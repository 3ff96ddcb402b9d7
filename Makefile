# A fresh machine in two commands:
#   make quickstart   set up, then prepare the bundled tiny Shakespeare, train `tiny-cpu`, sample and plot it
#   make test         set up, then run the whole test suite (what CI runs)
# Setting up installs torch and accel_gpt (editable, with the dev and plot extras) into VENV: the active virtual
# environment, else .venv in this folder (made when missing). TORCH is what `pip install` gets when VENV has no
# torch yet (the version CI pins by default); to choose the build, name it, e.g. CPU only:
#   make quickstart TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
# Offline, tiktoken's GPT-2 files must already be in TIKTOKEN_CACHE_DIR (see the README).

PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
TORCH ?= torch==2.13.0
EXTRAS ?= dev,plot
TRAIN_ARGS ?=
BIN := $(VENV)/bin

.PHONY: setup quickstart test lint

setup:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"

quickstart: setup
	$(BIN)/python run.py prepare
	$(BIN)/python run.py train --config tiny-cpu --resume auto $(TRAIN_ARGS)
	$(BIN)/python run.py sample --checkpoint runs/tiny-cpu --prompt "ROMEO:" --max_new_tokens 60
	$(BIN)/python run.py plot runs/tiny-cpu --out runs/tiny-cpu.png

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
