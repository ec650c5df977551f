PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BACKENDS ?= tensorflow jax torch
PYTEST_ARGS ?=

.PHONY: install demo test bench lint clean

$(BIN)/.installed: pyproject.toml requirements-dev.txt requirements-keras-hub.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -r requirements-keras-hub.txt
	touch $@

install: $(BIN)/.installed

demo: install
	KERAS_BACKEND=$${KERAS_BACKEND:-tensorflow} $(BIN)/pergrad demo

# The Keras backend is fixed at import: one pytest process per backend.
# TF_ENABLE_ONEDNN_OPTS=0: TensorFlow 2.21's oneDNN kernels corrupt memory in the
# vectorized per-example pass of attention layers (README, Limitations).
test: install
	$(BIN)/ruff check src tests benchmarks
	@for backend in $(BACKENDS); do \
		echo "=== KERAS_BACKEND=$$backend ==="; \
		TF_ENABLE_ONEDNN_OPTS=0 KERAS_BACKEND=$$backend $(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS) tests || exit 1; \
	done

bench: install
	KERAS_BACKEND=$${KERAS_BACKEND:-tensorflow} $(BIN)/python benchmarks/bench.py

lint: install
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) demo_output
