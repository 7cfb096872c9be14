# The two commands of the README. Each does its own set-up on a fresh machine:
# a virtualenv in .venv, a CPU torch wheel where there is no GPU, the package and its
# dev tools. Override TORCH_SPEC to pick another torch (e.g. TORCH_SPEC=torch on GPUs).

VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
STAMP := $(VENV)/.turnrl-installed
DEMO_OUT ?= runs/quickstart-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo test lint typecheck unit learning-proof clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# apt packages the tests use, installed where root has apt: bubblewrap isolates the code
# sandbox (turnrl.tools.sandbox); chromium + chromium-driver render report.html in the
# browser test; python3-pytest runs the swe libraries' own tests under /usr/bin/python3.
APT_PACKAGES := bubblewrap chromium chromium-driver python3-pytest
setup: $(STAMP)
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	/usr/bin/python3 -c "import pytest" >/dev/null 2>&1 || missing="$$missing python3-pytest"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "warning: missing$$missing (needs root + apt-get): without bubblewrap the code" \
	      "sandbox falls back to rlimits, which do not isolate; without chromium the report" \
	      "browser test is skipped"; \
	  fi; \
	fi

demo: setup
	$(VENV)/bin/turnrl train --out $(DEMO_OUT)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest -q

unit: setup
	$(VENV)/bin/pytest -q -m "not learning"

learning-proof: setup
	$(PY) benchmarks/learning_proof.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
