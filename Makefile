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
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed

.PHONY: install engine test test-unit serve lint-imports bench clean image-env

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e '.[serve,dev,eval]'
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
