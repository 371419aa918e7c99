# One entry point for people and CI. `make demo` and `make test` each create the
# virtual environment they need, so both work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: venv demo test lint bench protos images clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	$(BIN)/geoloco warmup  # the codec kernels into numba's cache: no run compiles them
	touch $(STAMP)

demo: venv
	$(BIN)/geoloco local --workers 4 --wan 20mbit/50ms --run-dir $(RUN_DIR) --overwrite

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python -m benchmarks.codec

protos: venv
	$(BIN)/python -m geoloco.protos.regenerate

images:
	docker/build_images.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
