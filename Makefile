# Every target that needs Python installs first, so `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default; GPU users: make install TORCH_SPEC='torch==2.13.0 --index-url ...'
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: install test demo lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev,etcd,hf]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Three simulated nodes on this host: a join, a preemption with notice, a node failure; table + loss.png.
demo: $(STAMP)
	$(PY) -m lightning_emig.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) tools/bench_step.py --out bench_results/step.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache outputs runs
