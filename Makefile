# A fresh machine in two commands:
#   make quickstart   set up for training, then prepare the bundled tiny Shakespeare, train `tiny-cpu`, sample and
#                     plot it
#   make test         set up for development, then run the whole test suite (what CI runs)
# `make test` first looks for tiktoken's GPT-2 BPE files, which the tests use (the `tiktoken` target:
# accel_gpt/tiktoken_files.py, standard library only, run by PYTHON before any environment exists), so that a machine
# without internet and without the files learns it in seconds, before anything is installed, in one line that says
# what to do. The quick start needs no GPT-2 files: its tokenizer is learned from the bundled text.
# Setting up installs torch and accel_gpt (editable) into VENV: the active virtual environment, else .venv in this
# folder (made when missing); with the plot extra (matplotlib) for `make quickstart`, and the dev extra too (pytest,
# ruff, lm-evaluation-harness) for `make test` and `make lint`. TORCH is what `pip install` gets when VENV has no
# torch yet (the version CI pins by default); to choose the build, name it, e.g. CPU only:
#   make quickstart TORCH="torch --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
TORCH ?= torch==2.13.0
TRAIN_ARGS ?=
BIN := $(VENV)/bin

.PHONY: tiktoken venv setup setup-dev quickstart test lint
.NOTPARALLEL:  # the check, then setting up, then the commands, in that order even under -j

tiktoken:
	@$(PYTHON) -m accel_gpt.tiktoken_files

venv:
	@test -x "$(BIN)/python" || $(PYTHON) -m venv "$(VENV)"
	@"$(BIN)/python" -c "import torch" 2>/dev/null || "$(BIN)/python" -m pip install --quiet $(TORCH)

setup: venv
	"$(BIN)/python" -m pip install --quiet -e ".[plot]"

setup-dev: venv
	"$(BIN)/python" -m pip install --quiet -e ".[dev,plot]"

quickstart: setup
	"$(BIN)/python" run.py prepare
	"$(BIN)/python" run.py train --config tiny-cpu --resume auto $(TRAIN_ARGS)
	"$(BIN)/python" run.py sample --checkpoint runs/tiny-cpu --prompt "ROMEO:" --max_new_tokens 60
	"$(BIN)/python" run.py plot runs/tiny-cpu --out runs/tiny-cpu.png

test: tiktoken setup-dev
	"$(BIN)/python" -m pytest -q

lint: setup-dev
	"$(BIN)/python" -m ruff check .
	"$(BIN)/python" -m ruff format --check .
