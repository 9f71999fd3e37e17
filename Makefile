# espnet3-flows: `make test` on a fresh machine installs everything and runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
# The venv lives outside the checkout, keyed by the pins, so a fresh clone (CI) reuses a
# finished install of the same pins instead of downloading ~7 GB again.
PINS_HASH := $(shell sha256sum constraints.txt | cut -c1-12)
VENV ?= $(HOME)/.cache/espnet3-flows/venv-$(PINS_HASH)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1

.PHONY: install system-deps test test-fast demo bench bench-quick clean

$(VENV)/.installed: constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed  ## Python environment with every test dependency

system-deps:  ## Debian packages for the SLURM and compose tests (needs root)
	@if ! command -v slurmctld >/dev/null || ! command -v docker-compose >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge docker-compose >/dev/null; \
	  else echo "system-deps: not root; install slurm-wlm munge docker-compose yourself" >&2; fi; fi

# The whole suite, SLURM included: starts a single-node SLURM cluster and stops it after.
test: install system-deps
	@set -o pipefail; source <(ci/slurm/start.sh) && trap 'ci/slurm/stop.sh >&2' EXIT && \
	  $(PY) -m pytest --run-slurm $(PYTEST_ARGS)

# Everything but the SLURM tests (no root needed).
test-fast: install
	$(PY) -m pytest $(PYTEST_ARGS)

demo: install  ## the main job on generated demo data, no server, local Dask
	$(PY) flows/collect_stats.py

bench: install
	$(PY) benchmarks/run.py

bench-quick: install
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf exp/ .pytest_cache build *.egg-info
