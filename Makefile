# Everything runs from a virtual environment in .venv, created and filled on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXAMPLES := model_repository
MODEL_DIR ?= $(EXAMPLES)

.PHONY: install run model test fuzz lint format protos k8s clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

## run: serve the repository MODEL_DIR (router on 127.0.0.1:8001); the examples' missing models are built first
## when it is the examples' own
run: $(STAMP)
ifeq ($(MODEL_DIR),$(EXAMPLES))
	$(BIN)/python -m examples.models.build --model-dir $(MODEL_DIR) --missing
endif
	$(BIN)/pipeline run --model-dir $(MODEL_DIR) $(ARGS)

## model: write the example models' files into $(MODEL_DIR) (the first `make run` writes the missing ones too)
model: $(STAMP)
	$(BIN)/python -m examples.models.build --model-dir $(MODEL_DIR) --force

## test: lint, type and architecture checks, then every test (unit, integration, end to end with real processes)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## fuzz: every fuzz test at $(FUZZ_EXAMPLES) cases each: requests over gRPC and HTTP, ensemble files, model
## repositories and config.pbtxt files (`make test` runs a few hundred of each)
FUZZ_EXAMPLES ?= 10000
fuzz: $(STAMP)
	PIPELINE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q --timeout 7200 --hypothesis-show-statistics \
		tests/unit/test_fuzz_router.py tests/unit/test_fuzz_config.py tests/unit/test_fuzz_repository.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## protos: regenerate pipeline/_gen from protos/ (a test fails when they are stale)
protos: $(STAMP)
	$(BIN)/python -m pipeline.tools.codegen

## k8s: regenerate the ensembles ConfigMap of deploy/k8s from ensembles/, the optional folder of YAML ensembles
## beside the model repository's (a test fails when it is stale)
k8s: $(STAMP)
	$(BIN)/python -m tests.deploy.test_k8s_manifests --write

clean:
	rm -rf $(VENV) $(MODEL_DIR)/.engines .pytest_cache .ruff_cache
	rm -f $(MODEL_DIR)/*/[0-9]*/model.pt $(MODEL_DIR)/*/[0-9]*/model.pt2 $(MODEL_DIR)/*/[0-9]*/model.onnx
