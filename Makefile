# kiln — two commands do all set-up on a fresh machine:
#   make engine   builds the default recipe (creates .venv and installs kiln first if needed)
#   make test     runs the tests
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
RECIPE ?= configs/tiny-llama.yaml
# CPU hosts get the CPU build of torch, installed before anything that depends on torch so that no
# multi-GB CUDA build is pulled. On a GPU host: make TORCH_SPEC='torch==2.9.1' (the CUDA build TRT-LLM pins).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# NVIDIA Dynamo (PyPI's newest) for the CPU Dynamo tests and `kiln serve --stack dynamo`.
DYNAMO_VERSION ?= 1.6.1
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed

.PHONY: install engine test test-unit serve lint-imports bench clean image-env

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e '.[serve,dev,eval]'
# Dynamo cannot be an extra of kiln's: ai-dynamo depends on aisimulate==0.13.0, a stub that downloads from
# another index (refused here), so the two wheels go in with --no-deps, then their other requirements
# (ai-dynamo-runtime wants pydantic<=2.13.5 and uvloop).
	$(VENV)/bin/python -m pip install -q --no-deps "ai-dynamo==$(DYNAMO_VERSION)" "ai-dynamo-runtime==$(DYNAMO_VERSION)"
	$(VENV)/bin/python -m pip install -q "pydantic>=2.10.6,<=2.13.5" "uvloop>=0.21.0" "aiohttp>=3.14.3,<4.0" \
	  "certifi>=2026.10.19" "kubernetes>=32.0.1,<33.0.0" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1.0" \
	  "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0" "zstandard>=0.23,<1.0"
	touch $@

install: $(STAMP)

engine: $(STAMP)
	$(KILN) build $(RECIPE)

serve: $(STAMP)
	$(KILN) serve $(RECIPE)

lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

test: $(STAMP) image-env
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not integration" $(PYTEST_ARGS)

# The NGC image's Python packages (the container table's row for TensorRT-LLM 1.2.1) in a cached venv, for the
# image_env tests (tests/image_env.py); a no-op when up to date.
image-env: $(STAMP)
	KILN_IMAGE_ENV_TORCH="$(TORCH_SPEC)" $(VENV)/bin/python -m tests.image_env

clean:
	rm -rf build triton_repo
