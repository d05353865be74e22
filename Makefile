# Everything a fresh machine needs: `make demo` and `make test` create the
# virtual environments on first use.
#
# `make test` runs the suite once per *leg*: one virtual environment per
# TensorFlow/Keras/backend combination. The legs are one table in Python,
# .ci/legs.py (`python3 .ci/legs.py list` prints it: each leg's venv, pins,
# environment, pytest arguments and what it proves); this file only calls it.
#
#   leg        venv                 what it proves
#   k3         .venv                TF 2.21 + Keras 3.15 (also used by demo/bench)
#   k3-oldest  .venvs/k3-oldest     the oldest pyproject claims: TF 2.16.2 + Keras 3.15.0
#   tfkeras    .venvs/tfkeras       TF 2.21 + tf_keras 2.21 (TF_USE_LEGACY_KERAS=1)
#   tf215      .venvs/tf215         TF 2.15.1 + its Keras 2.15 + tensorflow-addons 0.23
#   k3-jax     .venvs/k3-jax        Keras 3.15 on JAX 0.10 (CPU wheels), no TensorFlow
#   k3-torch   .venvs/k3-torch      Keras 3.15 on torch 2.13 (its CPU build), no TensorFlow
#
# Tests of a family a leg lacks skip with a reason (tests/support/families.py).
# After the legs, `make test` builds the documentation site (`make docs`,
# its own venv .venvs/docs from pyproject's `docs` extra, no TensorFlow) with
# --strict, so that a broken page, link or API reference fails it too.
PYTHON ?= python3
VENV   ?= .venv
VENVS  ?= .venvs
DEMO_ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?= --quick
BENCH_OUT  ?= docs/benchmarks
SHELL := bash

# `make test LEGS="k3 k3-jax"`: those legs only (default: every leg).
LEGS ?=
# `make test TEST_DOCS=` leaves the docs build out.
TEST_DOCS ?= yes
# The legs run in two lanes at once (the machines have 2 cores and a leg
# keeps about one busy); `make test TEST_LANES=1`: one after the other.
TEST_LANES ?= 2
# `make test TEST_KEEP_VENVS=no` removes each leg's venv once its tests end
# (.ci/run does, with PIP_NO_CACHE_DIR=1): all the legs' venvs together take
# about 9 GB, and CI's disk is shared (a run once failed with "No space left
# on device" installing its sixth leg). At most two venvs then exist at once.
TEST_KEEP_VENVS ?= yes
export PYTHON VENV VENVS LEGS TEST_DOCS TEST_LANES TEST_KEEP_VENVS PYTEST_ARGS
LEGS_PY := $(PYTHON) .ci/legs.py

.PHONY: venv venvs demo test test-full test-nightly bench docs venv-docs clean

## A leg's environment (installed on first use, and again when its pins or
## pyproject.toml change): `make venv-k3-jax`.
venv-%:
	$(LEGS_PY) venv $*

## One leg's tests: `make test-k3-jax PYTEST_ARGS=-x`.
test-%:
	$(LEGS_PY) venv $* && $(LEGS_PY) run $*

venv: venv-k3

# ---- the documentation site: MkDocs from pyproject's `docs` extra (exact
# pins) in its own venv, without the package or TensorFlow (the API reference
# reads the docstrings by static analysis). Reinstalled when pyproject.toml
# changes. Python 3.10 has no tomllib; pip vendors the same reader.
DOCS_VENV  := $(VENVS)/docs
DOCS_STAMP := $(DOCS_VENV)/.installed
define DOCS_EXTRA_PY
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["docs"]))
endef
export DOCS_EXTRA_PY

$(DOCS_STAMP): pyproject.toml
	rm -f $(DOCS_VENV)/.installed*
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -c "$$DOCS_EXTRA_PY" > $(DOCS_VENV)/requirements.txt
	$(DOCS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -r $(DOCS_VENV)/requirements.txt
	touch $@

venv-docs: $(DOCS_STAMP)

## Build the documentation site into site/ (every link, anchor and API
## reference must resolve: --strict).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/python -m mkdocs build --strict --site-dir site

## Every leg's environment (installs only what is missing).
venvs:
	$(LEGS_PY) venv $(LEGS)

## Train the digits CNN three ways and compare them (see README).
demo: venv-k3
	$(VENV)/bin/python examples/digits_demo.py $(DEMO_ARGS)

## The test suite in every leg (.ci/legs.py: two lanes, installs on first
## use), with the bounded CI hypothesis profile, then the docs build and the
## feature table; fails if any leg (or the docs) fails, after running them all.
test:
	$(LEGS_PY) test

## Opt-in, never part of `make test` (an upstream change must not turn CI
## red): the newest tf-nightly + keras-nightly from the package index, a fresh
## venv each run. First the list of private symbols and whether the nightlies
## still have them (`python -m accum_optimizer._compat`), then the suite's
## Keras 3 and TF1 tests, the fence test among them.
NIGHTLY_DIR  := $(VENVS)/nightly
NIGHTLY_PINS := tf-nightly keras-nightly
NIGHTLY_ARGS ?= -m 'not multiworker' --ignore=tests/contract/test_saved_checkpoints.py
test-nightly:
	rm -rf $(NIGHTLY_DIR)
	$(PYTHON) -m venv $(NIGHTLY_DIR)
	$(NIGHTLY_DIR)/bin/python -m pip install --quiet --upgrade pip
	$(NIGHTLY_DIR)/bin/python -m pip install --quiet --pre $(NIGHTLY_PINS) \
	  $$($(PYTHON) -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print(" ".join(repr(r) for r in d["test"] + d["demo"]))' | tr -d "'")
	$(NIGHTLY_DIR)/bin/python -m pip install --quiet --no-deps -e .
	@echo "==== nightly: $$($(NIGHTLY_DIR)/bin/python -m pip list 2>/dev/null | grep -iE '^(tf[-_]nightly|keras[-_]nightly) ' | tr -s ' ' | paste -sd ' ')"
	env -u TF_USE_LEGACY_KERAS KERAS_BACKEND=tensorflow TF_CPP_MIN_LOG_LEVEL=3 \
	  $(NIGHTLY_DIR)/bin/python -m accum_optimizer._compat; \
	env -u TF_USE_LEGACY_KERAS KERAS_BACKEND=tensorflow ACCUM_LEG=nightly ACCUM_LEG_PINS='$(NIGHTLY_PINS)' \
	  $(NIGHTLY_DIR)/bin/python -m pytest $(NIGHTLY_ARGS) $(PYTEST_ARGS)

## The same with the larger hypothesis profile (slow; opt-in).
test-full:
	HYPOTHESIS_PROFILE=full $(MAKE) --no-print-directory test

## Memory, step-overhead, sparse and step-profile benchmarks, then the large
## model's memory: regenerates docs/benchmarks/ (quick profile: about 15 min on
## 2 CPU cores; BENCH_OUT=somewhere_else to keep the docs as they are).
bench: venv-k3
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS) --out $(BENCH_OUT)
	$(VENV)/bin/python -m benchmarks.memory --models transformer_big --out $(BENCH_OUT)/large

clean:
	rm -rf $(VENV) $(VENVS) demo_output bench_output site .pytest_cache .hypothesis
