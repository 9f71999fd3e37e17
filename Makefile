# espnet3-flows: `make test` on a fresh machine installs everything and runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
# The venv lives outside the checkout (~7 GB, kept by `make clean`), keyed by the pins and by
# this checkout's path: it holds an editable install of *this* checkout, so two clones never
# share one (the second would import the first's code). CI (.ci/run) passes VENV= to build a
# fresh one every run. `make -s python` prints its interpreter.
# EXTRAS=dev,espnet,gpu CONSTRAINTS=constraints-gpu.txt: the same with dask-cuda (parallel.env=local_gpu).
# The espnet extra (frontend.type=espnet2, and its parity tests) also installs ESPnet with --no-deps.
EXTRAS ?= dev,espnet
CONSTRAINTS ?= constraints.txt
# (the key reads pyproject.toml's dependency lists only: other edits reinstall in place)
VENV_KEY := $(shell { cat $(CONSTRAINTS); \
  sed -n '/^dependencies = \[/,/^\]/p;/^\[project.optional-dependencies\]/,/^\[tool/p' pyproject.toml; \
  echo "$(CURDIR) $(EXTRAS)"; } | sha256sum | cut -c1-12)
VENV ?= $(HOME)/.cache/espnet3-flows/venv-$(VENV_KEY)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Prefect's client reads DO_NOT_TRACK: without it a first run in a terminal prints a telemetry notice
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1

.PHONY: python install python-venv system-deps test test-fast test-unpatched demo bench bench-quick clean distclean gpu-wheels \
	serve deploy worker stop status

# The interpreter must be >= 3.11 and able to make a venv with pip (Debian splits `venv` and
# `ensurepip` into python3.X-venv): as root that package is installed, otherwise make stops
# with the apt-get line to run.
python-venv:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
	  { echo "error: espnet3-flows needs Python >= 3.11; $(PYTHON) is" \
	    "$$($(PYTHON) --version 2>&1 || echo missing). Use: make PYTHON=python3.11 ..." >&2; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || \
	  ci/apt-install.sh "a virtual environment ($(PYTHON) has no ensurepip)" \
	    "$$($(PYTHON) -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')"

# A venv is trusted only with its completion stamp: the stamp is removed before any install
# step and written after the last, and a venv without it is deleted and built again, so an
# interrupted or failed install is never reused half-made. A venv whose stamp is only older
# than pyproject.toml / the pins is updated in place. The interpreter is checked only when a
# venv is created.
$(VENV)/.installed: $(CONSTRAINTS) pyproject.toml
	@if [ -e $(VENV) ] && [ ! -f $@ ]; then \
	  echo "install: $(VENV) has no completion stamp (an unfinished install): building it again" >&2; \
	  rm -rf $(VENV); fi
	@rm -f $@
	@if test -x $(PY); then echo "install: updating $(VENV) (pyproject.toml or the pins changed)" >&2; \
	else echo "install: building $(VENV): torch (a CUDA build), Prefect, Dask, lhotse, speechbrain," \
	  "ESPnet and the test tools, ~8 GB; 5-10 minutes on a first install, pip prints little meanwhile" >&2; fi
	@test -x $(PY) || { $(MAKE) --no-print-directory python-venv && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	@# (setuptools' editable build warns about folders named like the package in the working
	@# directory, in a 10-line banner: it finds only espnet3_flows/, so the banner is filtered out)
	PYTHONWARNINGS=ignore::Warning:setuptools.command.editable_wheel \
	  $(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	@if [[ ",$(EXTRAS)," == *,espnet,* ]]; then $(PY) -m pip install -q --no-deps -c $(CONSTRAINTS) espnet; fi
	touch $@

install: $(VENV)/.installed  ## Python environment with every test dependency

python: install  ## print the venv's interpreter: PY=$$(make -s python)
	@echo $(PY)

SYSTEM_PACKAGES := slurm-wlm munge docker-compose openssh-server
system-deps:  ## Debian packages for the SLURM, ssh and compose tests (installed when root)
	@if ! command -v slurmctld >/dev/null || ! command -v docker-compose >/dev/null || \
	    ! { command -v sshd >/dev/null || test -x /usr/sbin/sshd; }; then \
	  ci/apt-install.sh "make test (single-node SLURM, loopback sshd, docker-compose config)" $(SYSTEM_PACKAGES); fi

# The whole suite, SLURM included: starts a single-node SLURM cluster and stops it after. A
# SLURM that does not start stops here with its own error, before pytest runs.
SLURM_DIR := $(or $(ESPNET3_SLURM_DIR),/tmp/espnet3-flows-slurm)
# Three pytest processes (pytest-xdist): most of a test's time is spent waiting on the processes it
# starts (a server, a worker, a CLI run). Measured on 2 cores (/proc/stat over the whole run): with
# -n 3 the cores were 98 % busy and pytest took 1,114 s; with -n 2 the same ~2,200 CPU-seconds took
# 1,300-1,490 s (74-85 % busy). A module runs whole on one of them (its module-scoped servers start
# once), the modules of slow tests first (tests/conftest.py). TEST_JOBS=1: one process, in
# collection order. More than 3 was not measured: at 3 the 2 cores are already full.
TEST_JOBS ?= 3
XDIST = $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)
test: install system-deps
	@trap 'ci/slurm/stop.sh >&2' EXIT; \
	  ci/slurm/start.sh >/dev/null || { echo "error: make test: the single-node SLURM cluster" \
	    "did not start (its error is above)" >&2; exit 1; }; \
	  . $(SLURM_DIR)/env.sh && $(PY) -m pytest --run-slurm $(XDIST) $(PYTEST_ARGS)

# With every patch of another library off (ESPNET3_FLOWS_PATCHES=off, ~2 min): runs end to end still
# work (marker unpatched) and each test of what a patch does fails on its assertion (marker patch).
# `make test` runs the same selection as one of its tests (tests/test_patches_off.py), beside the others.
UNPATCHED = ESPNET3_FLOWS_PATCHES=off $(PY) -m pytest -m "patch or unpatched"
test-unpatched: install
	$(UNPATCHED) $(PYTEST_ARGS)

# Everything but the SLURM tests (no root needed).
test-fast: install
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The wheels benchmarks/gpu_check.sh installs on a lent GPU machine (Python 3.12, no registry there),
# into .whl/ (git-ignored); it checks that they and the tree stay under the 60 MiB that travel.
gpu-wheels: install  ## wheels for the GPU check on a lent device: .whl/ (benchmarks/gpu_wheels.sh)
	PYTHON=$(PY) benchmarks/gpu_wheels.sh

demo: install  ## the main job on generated demo data, no server, local Dask
	$(PY) flows/collect_stats.py

# Deployments on this machine (README, "Deployments"): a Prefect server on 127.0.0.1:$(PREFECT_PORT),
# the work pool and deployments, and a process worker; `make stop` stops the worker and server.
PREFECT_PORT ?= 4200
STACK := PREFECT=$(VENV)/bin/prefect PREFECT_PORT=$(PREFECT_PORT) deployments/local-stack.sh
serve: install  ## start a Prefect server in the background; prints the PREFECT_API_URL to export
	@$(STACK) serve
deploy: install  ## create the work pool and every deployment of deployments/prefect.yaml on it
	@$(STACK) deploy
worker: install  ## start a process worker for the pool in the background
	@$(STACK) worker
stop:  ## stop the worker and the server
	@$(STACK) stop
status:
	@$(STACK) status

bench: install
	$(PY) -m benchmarks

bench-quick: install
	$(PY) -m benchmarks --quick

clean:  ## outputs and build leftovers of this checkout
	rm -rf exp/ .pytest_cache build *.egg-info

# Only this checkout's venvs (their editable install is this directory, ci/checkout_venvs.py) and
# $(VENV): another clone's venv under the same cache may be in use.
distclean: clean  ## also this checkout's virtual environments under ~/.cache/espnet3-flows/
	@{ $(PYTHON) ci/checkout_venvs.py "$(CURDIR)" "$(HOME)/.cache/espnet3-flows"; \
	  test ! -e "$(VENV)" || echo "$(VENV)"; } | sort -u | while read -r venv; do \
	  echo "distclean: removing $$venv"; rm -rf "$$venv"; done
