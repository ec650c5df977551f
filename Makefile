PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BACKENDS ?= tensorflow jax torch
PYTEST_ARGS ?=
# The demo's backend: KERAS_BACKEND if set.
DEMO_BACKEND := $(or $(KERAS_BACKEND),tensorflow)

.PHONY: install demo test bench bench-peers lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The development environment: every backend, the tests' and benchmarks' packages, the
# benchmarks' DP peers among them (benchmarks/peers.py, dp_epoch.py; tests/test_benchmarks.py
# checks TF Privacy and jax-privacy against pergrad): Opacus and jax-privacy (the bench extra,
# in requirements-dev.txt), then without dependencies keras-hub, TF Privacy and tf_keras of the
# installed TensorFlow's minor version (tf_keras requires the package `tensorflow`, which would
# install beside tensorflow-cpu; TF Privacy's pins, tensorflow~=2.4, numpy~=1.21,
# dp-accounting==0.4.3, would move the project's versions).
$(BIN)/.installed: pyproject.toml requirements-dev.txt requirements-keras-hub.txt requirements-peers.txt \
		requirements-tensorflow.txt requirements-jax.txt requirements-torch.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -r requirements-keras-hub.txt -r requirements-peers.txt \
		"tf-keras~=$$(TF_CPP_MIN_LOG_LEVEL=3 $(BIN)/python -c \
		'import tensorflow as tf; print(tf.__version__.rsplit(".", 1)[0])' 2>/dev/null).0"
	touch $@

install: $(BIN)/.installed

# The demo's environment: one backend and the demo's scikit-learn and matplotlib, in the same
# .venv (a later `make test` adds the rest; after it, nothing is left to install).
$(BIN)/.demo-%: pyproject.toml requirements-%.txt | $(BIN)/python
	test -f $(BIN)/.installed || $(BIN)/pip install -q -r requirements-$*.txt -e ".[demo]"
	touch $@

demo: $(BIN)/.demo-$(DEMO_BACKEND)
	KERAS_BACKEND=$(DEMO_BACKEND) $(BIN)/pergrad demo

# The Keras backend is fixed at import: one pytest process per backend. TensorFlow
# runs with its own defaults (oneDNN on, on x86): pergrad's vectorized pass avoids the
# products its matmul corrupts (README, Limitations), and tests/backend/test_vectorized_kernels.py
# forces oneDNN on in a process of its own. On JAX the suite's time is mostly XLA compiling
# tiny models: LLVM's optimization level 0 compiles them in about 20% less CPU (XLA's own
# graph optimizations still run; set XLA_FLAGS to test with another).
test: install
	$(BIN)/ruff check src tests benchmarks
	@for backend in $(BACKENDS); do \
		echo "=== KERAS_BACKEND=$$backend ==="; \
		flags=$${XLA_FLAGS-$$(test $$backend = jax && echo --xla_backend_optimization_level=0)}; \
		XLA_FLAGS=$$flags KERAS_BACKEND=$$backend $(BIN)/python -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS) tests \
			|| exit 1; \
	done

bench: install
	KERAS_BACKEND=$${KERAS_BACKEND:-tensorflow} $(BIN)/python benchmarks/bench.py

# The benchmarks' DP peers are part of `make install` (above); kept as a name for it.
bench-peers: install

lint: install
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) demo_output
