# Two commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The package alone (for `make run`), and with the test extras (for `make test`).
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed

# Train the tiny config on the CPU on the embedded corpus, then generate from the result.
# Sampling with top-k at temperature 0.9: a model this small collapses into runs of spaces
# at lower temperatures (greedy gives only spaces).
run: $(VENV)/.installed
	rm -rf runs/tiny
	JAX_PLATFORMS=cpu $(PY) -m jaxllm.train --config configs/tiny.yaml
	JAX_PLATFORMS=cpu $(PY) -m jaxllm.generate --run runs/tiny --prompt 'def fibonacci(n):\n' \
		--max-new-tokens 300 --temperature 0.9 --top-k 40

# Two worker processes, each taking whole test files (module fixtures are built once).
test: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) runs .cache
