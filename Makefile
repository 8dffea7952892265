# Everything runs from a virtual environment in .venv, created and filled on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXAMPLES := model_repository
MODEL_DIR ?= $(EXAMPLES)

.PHONY: install front front-check run model test fuzz lint format protos k8s docs docs-assets docs-reference clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[test,bench,docs]"
	touch $(STAMP)

## install: the virtual environment, and the documentation's JavaScript (docs-assets; where npm is missing, one
## line says so and `make docs` fetches it later)
install: $(STAMP)
	-@scripts/docs-assets.sh

## front: build the compiled front door (front/: pipeline-front, C++ on grpc++) into $(BIN); as root on Debian
## its packages are installed first with apt; where it cannot be built, one line says so and the router's Python
## ingress serves the gRPC port (`pipeline run --front auto`)
FRONT_BUILD ?= front/build
front: $(STAMP)
	scripts/build-front.sh $(FRONT_BUILD) $(BIN)

## front-check: the front's tests once with pipeline-front built with AddressSanitizer and
## UndefinedBehaviorSanitizer; a finding fails them
front-check: $(STAMP)
	scripts/build-front.sh front/build/sanitize front/build/sanitize -DFRONT_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	rm -rf front/build/sanitize/findings && mkdir -p front/build/sanitize/findings
	PIPELINE_FRONT_BINARY=$(abspath front/build/sanitize/pipeline-front) \
		ASAN_OPTIONS=detect_leaks=1:log_path=$(abspath front/build/sanitize/findings/asan) \
		UBSAN_OPTIONS=print_stacktrace=1:log_path=$(abspath front/build/sanitize/findings/ubsan) \
		$(BIN)/python -m pytest -q tests/integration/test_front.py tests/integration/test_front_batches.py tests/e2e/test_front.py
	@if ls front/build/sanitize/findings/* >/dev/null 2>&1; then cat front/build/sanitize/findings/*; \
		echo "front-check: the sanitizers found the above"; exit 1; else echo "front-check: no finding"; fi

## run: serve the repository MODEL_DIR (router on 127.0.0.1:8001); the examples' missing models are built first
## when it is the examples' own
run: $(STAMP) front
ifeq ($(MODEL_DIR),$(EXAMPLES))
	$(BIN)/python -m examples.models.build --model-dir $(MODEL_DIR) --missing
endif
	$(BIN)/pipeline run --model-dir $(MODEL_DIR) $(ARGS)

## model: write the example models' files into $(MODEL_DIR) (the first `make run` writes the missing ones too)
model: $(STAMP)
	$(BIN)/python -m examples.models.build --model-dir $(MODEL_DIR) --force

## test: lint, type and architecture checks, the documentation site built strictly, then every test (unit,
## integration, end to end with real processes; the docs' runnable examples among them)
test: $(STAMP) front
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/lint-imports
	$(MAKE) docs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## docs: build the documentation site from docs/ into $(DOCS_SITE), strictly: a broken link or anchor, or a
## page left out of mkdocs.yml's navigation, fails the build
DOCS_SITE ?= site
docs: $(STAMP) docs-assets
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir $(abspath $(DOCS_SITE))

## docs-assets: Mermaid's minified file from its npm package, pinned and checked, into docs/assets/javascripts/
## (git-ignored): the site serves it, no CDN; fetched once, then every build is offline
docs-assets:
	scripts/docs-assets.sh

## docs-reference: regenerate docs/reference/ from the commands' argument parsers (a test fails when it is stale)
docs-reference: $(STAMP)
	$(BIN)/python -m pipeline.docgen

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
	rm -rf $(VENV) $(FRONT_BUILD) $(MODEL_DIR)/.engines .pytest_cache .ruff_cache $(DOCS_SITE)
	rm -f $(MODEL_DIR)/*/[0-9]*/model.pt $(MODEL_DIR)/*/[0-9]*/model.pt2 $(MODEL_DIR)/*/[0-9]*/model.onnx
