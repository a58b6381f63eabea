# The two commands of the README's quick start, and their shared install step.
VENV ?= .venv
STAMP := $(VENV)/.kvxfer-installed
# the vLLM environment tools/bootstrap.sh builds beside it (docs/vllm.md)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvxfer-installed
# the SGLang environment, likewise (docs/sglang.md)
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvxfer-installed

.PHONY: loopback test info

# `make test` needs all three environments: vLLM's and SGLang's packages then install beside the main one
PREFETCH := $(if $(filter test,$(MAKECMDGOALS)),$(VLLM_VENV))
SGLANG_PREFETCH := $(if $(filter test,$(MAKECMDGOALS)),$(SGLANG_VENV))

# the exact versions each environment installs (tools/bootstrap.sh, tools/freeze_constraints.sh)
PINS := $(wildcard tools/constraints/*.txt)

$(STAMP): pyproject.toml setup.py tools/bootstrap.sh $(PINS)
	KVXFER_SKIP_VLLM=1 KVXFER_SKIP_SGLANG=1 KVXFER_VLLM_PREFETCH=$(PREFETCH) KVXFER_SGLANG_PREFETCH=$(SGLANG_PREFETCH) bash tools/bootstrap.sh $(VENV)
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml setup.py tools/bootstrap.sh $(PINS)
	KVXFER_VLLM_ONLY=1 KVXFER_VLLM_VENV=$(VLLM_VENV) bash tools/bootstrap.sh $(VENV)

$(SGLANG_STAMP): pyproject.toml setup.py tools/bootstrap.sh $(PINS)
	KVXFER_SGLANG_ONLY=1 KVXFER_SGLANG_VENV=$(SGLANG_VENV) bash tools/bootstrap.sh $(VENV)

loopback: $(STAMP)  ## a real prefill -> decode KV handoff between two processes, on the default backend
	$(VENV)/bin/kvxfer loopback

# pytest-xdist workers, two files at a time (most tests wait on peers, timeouts and engines): each
# file runs whole in one worker, so its module fixtures (a vLLM pair, say) start once, and the files
# that start vLLM engines share one worker (tests/conftest.py, pytest_xdist_make_scheduler)
TEST_WORKERS ?= 2

test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP)  ## the whole test suite (the vLLM tests run in $(VLLM_VENV), SGLang's ranks in $(SGLANG_VENV))
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(VENV)/bin/python -m pytest -m serial

info: $(STAMP)
	$(VENV)/bin/kvxfer info
