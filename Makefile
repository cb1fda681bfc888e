# Two commands do all the set-up on a fresh machine:
#   make serve   serve the built-in tiny model: the OpenAI API on 127.0.0.1:9000 and tritonserver
#                (HTTP 8000, gRPC 8001, metrics 8002), via `paged-llm serve`
#   make serve-triton  tritonserver alone on model_repository/ (a link to the package's template,
#                backend_src/paged_llm/model_repository)
#   make test    lint + all tests (unit, integration on CPU, end-to-end against a real tritonserver)
# Both bootstrap what they need (scripts/setup.sh: .venv, pinned deps, backend dir, tiny model).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
MODEL ?= tiny-qwen3
ADDRESS ?= 127.0.0.1
MODEL_REPOSITORY ?= model_repository
PYTEST_ARGS ?=

.PHONY: setup serve serve-triton test test-unit lint format bench-offline clean

setup:
	@bash scripts/setup.sh

serve: setup
	$(VENV)/bin/paged-llm serve $(MODEL) --address $(ADDRESS) --port $(OPENAI_PORT) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

serve-triton: setup
	$(PY) -m paged_llm.launcher.launch serve --model-repository $(MODEL_REPOSITORY) --address $(ADDRESS) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup lint
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check backend_src clients scripts tests model_repository

format: setup
	$(VENV)/bin/ruff format backend_src clients scripts tests model_repository

bench-offline: setup
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
