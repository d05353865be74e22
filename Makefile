# Everything a fresh machine needs: `make demo` and `make test` create the
# virtual environments on first use.
#
# `make test` runs the suite once per *leg*: one virtual environment per
# TensorFlow/Keras combination, each installed from pyproject's extras plus
# the leg's exact pins below (the package itself is installed editable).
#
#   leg        venv                 what it proves
#   k3         .venv                TF 2.21 + Keras 3.15 (also used by demo/bench)
#   k3-oldest  .venvs/k3-oldest     the oldest pyproject claims: TF 2.16.2 + Keras 3.15.0
#   tfkeras    .venvs/tfkeras       TF 2.21 + tf_keras 2.21 (TF_USE_LEGACY_KERAS=1)
#   tf215      .venvs/tf215         TF 2.15.1 + its Keras 2.15 + tensorflow-addons 0.23
#
# Tests of a family a leg lacks skip with a reason (tests/support/families.py).
PYTHON ?= python3
VENV   ?= .venv
VENVS  ?= .venvs
DEMO_ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?= --quick
BENCH_OUT  ?= bench_output
SHELL := bash

LEGS ?= k3 k3-oldest tfkeras tf215

# Which tests a leg runs. Every leg collects tests/ (core/, contract/ and one
# folder per family; tests of a family the leg lacks skip with the reason);
# `--leave-out M[,M]` (tests/conftest.py) deselects the tests that carry all
# those markers, leaving -m and -k free for PYTEST_ARGS. Each test carries
# its family's marker (keras3, keras2, legacy, tfa, tf1); the contract tests
# of weighted windows, flush, resume and accumulation schedules also carry
# `windows`.
#
# The TF1 family runs in k3 and tf215: on the newest and the oldest
# TensorFlow the legs have.
TF1_TESTS := --leave-out tf1

# ---- per-leg environment: directory, Python, extras, pins, pytest env/args
DIR_k3         := $(VENV)
PYTHON_k3      := $(PYTHON)
EXTRAS_k3      := test,demo,keras3
PINS_k3        := tensorflow==2.21.* keras==3.15.*
ENV_k3         :=
# Everything: the Keras 3 and TF1 families' folders, their contract cells,
# core/, the multi-worker processes and the benchmark smoke run.
ARGS_k3        :=

DIR_k3-oldest    := $(VENVS)/k3-oldest
PYTHON_k3-oldest := $(PYTHON)
EXTRAS_k3-oldest := test,keras3
PINS_k3-oldest   := tensorflow==2.16.2 keras==3.15.0
ENV_k3-oldest    :=
# This leg exists to prove the oldest versions pyproject claims (Keras < 3.15
# fails the suite: README, Compatibility): every contract property (Keras 3's
# cells: the large batch for every optimizer class, schedules, EMA, weighted
# windows, flush, resume in Keras 3's checkpoint and store formats, missing
# gradients, pass-through, MirroredStrategy), argument validation and
# dispatch (core/) and Keras 3's API. The rest of tests/keras3/ checks the
# package's own logic through the same Keras code paths (fit-level windows,
# saving formats, distribution, sparse windows, mixed precision, XLA,
# hardening, caveats, the multi-worker processes, the benchmark smoke run,
# the property tests) and runs in k3 only; the TF1 family in k3 and tf215
# (time budget). (What changes between versions most, the private Keras/TF
# symbols the family touches, is for the private-symbol test of issue 16,
# item 3, which belongs in every leg.)
ARGS_k3-oldest   := $(TF1_TESTS) tests/test_environment.py tests/core/test_arguments.py tests/core/test_dispatch.py \
  tests/contract tests/keras3/test_api.py

DIR_tfkeras    := $(VENVS)/tfkeras
PYTHON_tfkeras := $(PYTHON)
EXTRAS_tfkeras := test,keras2
PINS_tfkeras   := tensorflow==2.21.* tf_keras==2.21.*
ENV_tfkeras    := TF_USE_LEGACY_KERAS=1
# Both Keras 2 legs prove their versions of the keras2 and legacy families;
# the window contract tests (weighted windows, flush, resume, accumulation
# schedules) of each family run in one of them: the legacy family's in
# tf215, beside tensorflow-addons (time budget).
ARGS_tfkeras   := $(TF1_TESTS) --leave-out legacy,windows

# TensorFlow 2.15 has wheels for Python 3.9-3.11 only.
DIR_tf215      := $(VENVS)/tf215
PYTHON_tf215   := $(PYTHON)
EXTRAS_tf215   := test,addons
PINS_tf215     := tensorflow==2.15.1 tensorflow-addons==0.23.0 numpy<2
ENV_tf215      :=
# (The Keras 2 new API's window contract tests run in tfkeras, on tf_keras 2.21.)
ARGS_tf215     := --leave-out keras2,windows

.PHONY: venv venvs demo test test-full bench clean \
	$(addprefix venv-,$(LEGS)) $(addprefix test-,$(LEGS))

# A leg's stamp is named after a checksum of its Python, extras and pins, so
# changing a pin reinstalls that leg (and only it); editing pyproject.toml
# reinstalls every leg.
define LEG_RULES
STAMP_$(1) := $$(DIR_$(1))/.installed-$$(shell printf '%s' "$$(PYTHON_$(1)) $$(EXTRAS_$(1)) $$(PINS_$(1))" | cksum | cut -d' ' -f1)

$$(STAMP_$(1)): pyproject.toml
	rm -f $$(DIR_$(1))/.installed*
	$$(PYTHON_$(1)) -m venv $$(DIR_$(1))
	$$(DIR_$(1))/bin/python -m pip install --quiet --upgrade pip
	$$(DIR_$(1))/bin/python -m pip install --quiet -e '.[$$(EXTRAS_$(1))]' $$(foreach p,$$(PINS_$(1)),'$$(p)')
	touch $$@

venv-$(1): $$(STAMP_$(1))

test-$(1): $$(STAMP_$(1))
	@echo "==== leg $(1): $$(PINS_$(1)) $$(ENV_$(1))"
	env -u TF_USE_LEGACY_KERAS KERAS_BACKEND=tensorflow $$(ENV_$(1)) \
	  ACCUM_LEG=$(1) ACCUM_LEG_PINS='$$(PINS_$(1))' \
	  $$(DIR_$(1))/bin/python -m pytest $$(ARGS_$(1)) $$(PYTEST_ARGS)
endef
$(foreach leg,$(LEGS),$(eval $(call LEG_RULES,$(leg))))

venv: venv-k3

## Every leg's environment (installs only what is missing).
venvs: $(addprefix venv-,$(LEGS))

## Train the digits CNN three ways and compare them (see README).
demo: $(STAMP_k3)
	$(DIR_k3)/bin/python examples/digits_demo.py $(DEMO_ARGS)

## The test suite in every leg, one after the other, with the bounded CI
## hypothesis profile; fails if any leg fails, after running them all.
test:
	@mkdir -p $(VENVS); failed=0; summary=""; \
	for leg in $(LEGS); do \
	  start=$$SECONDS; \
	  $(MAKE) --no-print-directory venv-$$leg || { failed=$$((failed+1)); summary+="$$leg: install FAILED"$$'\n'; continue; }; \
	  mid=$$SECONDS; \
	  $(MAKE) --no-print-directory test-$$leg 2>&1 | tee $(VENVS)/.test-$$leg.log; rc=$${PIPESTATUS[0]}; \
	  line=$$(grep -E '^(=+ )?[0-9a-z ,]*(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' $(VENVS)/.test-$$leg.log | tail -n 1 | sed -E 's/^=+ | =+$$//g'); \
	  [ $$rc -eq 0 ] && result=ok || { result=FAILED; failed=$$((failed+1)); }; \
	  summary+="$$leg: $$result ($${line:-no pytest summary}); install $$((mid-start)) s, tests $$((SECONDS-mid)) s"$$'\n'; \
	done; \
	echo "==== make test: one line per leg"; printf '%s' "$$summary"; \
	echo "legs: $$(( $(words $(LEGS)) - failed )) passed, $$failed failed"; \
	[ $$failed -eq 0 ]

## The same with the larger hypothesis profile (slow; opt-in).
test-full:
	HYPOTHESIS_PROFILE=full $(MAKE) --no-print-directory test

## Memory, step-overhead and sparse benchmarks (quick profile: < 10 min on 2 CPU cores).
bench: $(STAMP_k3)
	$(DIR_k3)/bin/python -m benchmarks $(BENCH_ARGS) --out $(BENCH_OUT)

clean:
	rm -rf $(VENV) $(VENVS) demo_output bench_output .pytest_cache .hypothesis
