# Everything a fresh machine needs: `make demo` and `make test` create the
# virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv demo test test-full clean

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

clean:
	rm -rf $(VENV) demo_output .pytest_cache .hypothesis
