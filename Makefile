# Two entry points, both idempotent on a fresh clone:
#   make bench   set up .venv, then run the main job (qcomm bench on 2 local ranks;
#                table on the terminal, figures in out/bench.json and out/bench.png)
#   make test    set up .venv, then run ruff, mypy and pytest
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip reads this file; pins torch so no CUDA build of a newer release is pulled in.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup bench gpu-check test lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile $(wildcard plugins/*/pyproject.toml) $(wildcard plugins/*/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[cpu,dev]'
	# TorchRec (tests only) without its CUDA dependency fbgemm-gpu: fbgemm-gpu-cpu
	# (cpu extra) provides the same module. Its other dependencies go in first, so
	# no later pip run reports fbgemm-gpu missing (`pip check` does: expected).
	$(PIP) tensordict torchmetrics tqdm pyre-extensions
	$(PIP) --no-deps torchrec==1.8.0
	set -e; for d in plugins/*/; do if test -f $$d/pyproject.toml; then $(PIP) -e $$d; fi; done
	touch $@

bench: $(STAMP)
	mkdir -p out
	$(BIN)/qcomm bench --json out/bench.json --plot out/bench.png

# On a machine with one CUDA GPU: the collectives, all-reduce and DDP hook on NCCL
# and gloo, host syncs, streams, codec speed against fbgemm (docs/gpu_check.rst).
# Exits 2 without CUDA; `$(BIN)/python tools/gpu_check.py --dry-run` runs on CPU.
gpu-check: $(STAMP)
	mkdir -p out
	$(BIN)/python tools/gpu_check.py --out out/gpu_check.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q; rc=$$?; test $$rc -eq 0 -o $$rc -eq 5

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV)
