# One entry point for people and CI. `make demo` and `make test` each create the
# virtual environment they need, so both work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: venv demo check test test-stress lint bench protos images clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	$(BIN)/geoloco warmup  # the codec kernels into numba's cache: no run compiles them
	touch $(STAMP)

demo: venv
	$(BIN)/geoloco local --workers 4 --wan 20mbit/50ms --run-dir $(RUN_DIR) --overwrite

# the inner loop: lint and the unit tests not marked slow (no processes, no long runs)
check: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests/unit -m "not slow" -q

# everything: lint, unit, integration (real processes), Docker (skipped without an engine),
# spread over XDIST pytest-xdist workers (tests/conftest.py: an integration module stays in one)
XDIST ?= 3
test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(XDIST)

# the flake hunt: the integration suite 3 times in a row with every core busy-looping
test-stress: venv
	$(BIN)/python tests/stress.py --runs 3 -- -n $(XDIST)

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
