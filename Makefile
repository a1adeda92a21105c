# Two commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# Train the tiny config on the CPU on the embedded corpus, then generate from the result.
run: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m jaxllm.train --config configs/tiny.yaml train.run_dir=runs/tiny
	JAX_PLATFORMS=cpu $(PY) -m jaxllm.generate --run runs/tiny --prompt "def fibonacci(n):" --max-new-tokens 200

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest tests

clean:
	rm -rf $(VENV) runs .cache
