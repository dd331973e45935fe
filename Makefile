# Two commands: `make demo` and `make test`. Both create .venv/ on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= /tmp/rose-demo

.PHONY: install demo test test-slow lint clean

install: $(STAMP)

# CPU PyTorch first (these machines serve torch==2.13.0 from a local file), so that the
# package's `torch>=2.4` requirement is already met and pip never pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/rose init-model --arch qwen3 --preset tiny --out $(DEMO_DIR) --seed 0
	$(BIN)/rose generate --model $(DEMO_DIR) --prompt "Hello, ROSE" --max-tokens 24

test: install
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
