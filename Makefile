# The two commands of the README's quick start, and their shared install step.
VENV ?= .venv
STAMP := $(VENV)/.kvxfer-installed

.PHONY: loopback test info

$(STAMP): pyproject.toml setup.py tools/bootstrap.sh
	bash tools/bootstrap.sh $(VENV)
	touch $(STAMP)

loopback: $(STAMP)  ## a real prefill -> decode KV handoff between two processes, on the default backend
	$(VENV)/bin/kvxfer loopback

test: $(STAMP)  ## the whole test suite
	$(VENV)/bin/python -m pytest

info: $(STAMP)
	$(VENV)/bin/kvxfer info
