# The two set-up commands of the README. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build that lies on this machine's disk; a plain `torch`
# requirement would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" bash launch/demo.sh

test: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo_out .pytest_cache
