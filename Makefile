# Two commands for a fresh machine:
#   make lab    set up .venv, start an engine on the embedded default model and the main job
#   make test   set up .venv and run lint + the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup overlay lab test lint generate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: without CUDA take the CPU build (a bare `torch` pulls a multi-GB CUDA wheel).
$(STAMP): $(BIN)/python pyproject.toml
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q ".[test]"
	$(MAKE) --no-print-directory overlay
	touch $(STAMP)

# Put the working tree ahead of the installed copy, so edits need no reinstall. The kernels/
# folder is exposed as `workbench_kernels`, exactly as the wheel installs it.
overlay:
	mkdir -p .dev && ln -sfn ../workbench .dev/workbench && ln -sfn ../kernels .dev/workbench_kernels
	echo "import sys; sys.path.insert(0, '$(CURDIR)/.dev')" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_workbench_dev.pth"

setup: $(STAMP)

lab: setup
	$(BIN)/workbench lab

generate: setup
	$(BIN)/workbench generate "Once upon a time, there was a little"

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info
