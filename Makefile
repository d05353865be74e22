# Everything a fresh machine needs: `make demo` and `make test` create the
# virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?= --quick
BENCH_OUT  ?= bench_output

.PHONY: venv demo test test-full bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

## Train the digits CNN three ways and compare them (see README).
demo: $(STAMP)
	$(BIN)/python examples/digits_demo.py $(DEMO_ARGS)

## The test suite with the bounded CI hypothesis profile.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## The same suite with the larger hypothesis profile (slow; opt-in).
test-full: $(STAMP)
	HYPOTHESIS_PROFILE=full $(BIN)/python -m pytest $(PYTEST_ARGS)

## Memory, step-overhead and sparse benchmarks (quick profile: < 10 min on 2 CPU cores).
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS) --out $(BENCH_OUT)

clean:
	rm -rf $(VENV) demo_output bench_output .pytest_cache .hypothesis
