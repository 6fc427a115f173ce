# kvmesh: `make demo` runs a local fleet, `make test` runs the suite. Both set up .venv first.
# `make compose-test` runs docker-compose.yml end to end (as root: it may install Docker and start dockerd).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard proto/kvmesh/v1/*.proto)

.PHONY: demo test test-fast compose-test proto setup clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh control_plane/_probe.c
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup_venv.sh
	touch $@

setup: $(VENV)/.installed

# Regenerate the gRPC code from proto/ (a test fails when it is stale).
proto: setup
	$(PY) -m kvmesh.protogen

demo: setup
	$(VENV)/bin/kvmesh demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

# Builds the images, brings the compose stack up, proves a pull between its engines, takes it down (docs/deployment.md).
compose-test: setup
	PY=$(abspath $(PY)) bash scripts/compose_test.sh

clean:
	rm -rf $(VENV) build *.egg-info
