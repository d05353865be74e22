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

ALL_LEGS := k3 k3-oldest tfkeras tf215 k3-jax k3-torch
LEGS ?= $(ALL_LEGS)
# `make test TEST_DOCS=` leaves the docs build out.
TEST_DOCS ?= yes
# The legs run in two lanes at once (the machines have 2 cores and a leg
# keeps about one busy): LANE1_LEGS in one, in this order, the others in the
# other; installs take turns (one lock), so that two editable installs never
# write the package's metadata at once. `make test TEST_LANES=1`: one after
# the other.
TEST_LANES ?= 2
LANE1_LEGS := k3 k3-jax k3-torch
# `make test TEST_KEEP_VENVS=no` removes each leg's venv once its tests end
# (.ci/run does, with PIP_NO_CACHE_DIR=1): all the legs' venvs together take
# about 9 GB, and CI's disk is shared (a run once failed with "No space left
# on device" installing its sixth leg). At most two venvs then exist at once.
TEST_KEEP_VENVS ?= yes
rparen := )

# Which tests a leg runs. Every leg collects tests/ (core/, contract/ and one
# folder per family; tests of a family the leg lacks skip with the reason);
# `--leave-out M[,M]` (tests/conftest.py) deselects the tests that carry all
# those markers, leaving -m and -k free for PYTEST_ARGS. Each test carries
# its family's marker (keras3, keras2, legacy, tfa, tf1); every contract
# test carries `contract`, and those of weighted windows, flush, resume and
# accumulation schedules also carry `windows`.
#
# The TF1 family runs whole in tf215 (the oldest TensorFlow the legs have);
# in k3 (the newest) its own folder, tests/tf1/, runs too, its contract cells
# only in tf215 (time budget: the planner's tests came in with issue 21).
TF1_TESTS := --leave-out tf1

# keras-hub (tests/clients/: its tasks trained with the wrapper), one pinned
# version. On TensorFlow (k3) installed as a user would, with every dependency
# (tensorflow-text among them). On JAX and torch (k3-jax, k3-torch) without
# TensorFlow: tensorflow-text, one of its requirements, brings TensorFlow, so
# keras-hub is installed --no-deps (NODEPS_<leg>, after the leg's install)
# and KERAS_HUB_DEPS are its other requirements (0.32's METADATA), plus grain,
# what keras-hub's `fit` batches arrays with where TensorFlow is absent.
KERAS_HUB      := keras-hub==0.32.*
KERAS_HUB_DEPS := absl-py numpy packaging regex rich kagglehub!=1.0.1 kagglesdk==0.1.28 sentencepiece tokenizers grain

# ---- per-leg environment: directory, Python, extras, pins, pytest env/args
# (NODEPS_<leg>: installed with --no-deps after the pins; most legs have none.)
DIR_k3         := $(VENV)
PYTHON_k3      := $(PYTHON)
EXTRAS_k3      := test,demo,keras3,tensorflow
PINS_k3        := tensorflow==2.21.* keras==3.15.* $(KERAS_HUB)
ENV_k3         :=
# Everything but the TF1 family's contract cells: the Keras 3 and TF1
# families' folders, Keras 3's contract cells, core/, the planner, the
# multi-worker processes, the benchmark smoke run and tests/clients/.
ARGS_k3        := --leave-out tf1,contract

# The framework-free core through the NumPy reference backend
# (tests/support/numpy_backend.py), and its import without any framework: in
# every leg (the legs that collect tests/ whole run them as part of it).
CORE_NUMPY := tests/core/test_window_numpy.py tests/core/test_core_without_framework.py
# What every leg runs (no framework needed): the core above, and
# tests/core/test_references.py (the sources read statically: every
# tests/...py path and every API reference of the package, docs and tools
# resolves; no test imports benchmarks).
EVERY_LEG := $(CORE_NUMPY) tests/core/test_references.py

OLDEST_CONTRACT := $(addprefix tests/contract/test_,$(addsuffix .py,between_updates ema large_batch \
  missing_gradients nonfinite pass_through resume saved_checkpoints strategies))

DIR_k3-oldest    := $(VENVS)/k3-oldest
PYTHON_k3-oldest := $(PYTHON)
EXTRAS_k3-oldest := test,keras3,tensorflow
PINS_k3-oldest   := tensorflow==2.16.2 keras==3.15.0
ENV_k3-oldest    :=
# This leg exists to prove the oldest versions pyproject claims (Keras < 3.15
# fails the suite: README, Compatibility): the contract properties (Keras 3's
# cells: the large batch for every optimizer class, nothing moving between
# updates, EMA, resume in Keras 3's checkpoint and store formats and of the
# checkpoints saved by earlier versions, missing gradients, non-finite
# policies, pass-through, strategies; weighted windows, flush, accumulation
# schedules and the fit-level windows prove the shared window logic and run
# in k3 only: time budget), the framework-free core, the references, argument validation and dispatch, the private-symbol
# fence (core/test_compat.py: every private Keras/TF symbol resolves in
# these versions), Keras 3's API and subclassing. The rest of tests/keras3/
# checks the package's own logic through the same Keras code paths
# (fit-level windows, saving formats, distribution, sparse windows, mixed
# precision, XLA, hardening, caveats, the multi-worker processes, the
# benchmark smoke run, the property tests) and runs in k3 only; the TF1
# family in k3 and tf215 (time budget).
ARGS_k3-oldest   := $(TF1_TESTS) tests/test_environment.py $(EVERY_LEG) tests/core/test_arguments.py tests/core/test_dispatch.py \
  tests/core/test_compat.py tests/core/test_version.py $(OLDEST_CONTRACT) tests/keras3/test_api.py \
  tests/keras3/test_subclass.py

DIR_tfkeras    := $(VENVS)/tfkeras
PYTHON_tfkeras := $(PYTHON)
EXTRAS_tfkeras := test,keras2
PINS_tfkeras   := tensorflow==2.21.* tf_keras==2.21.*
ENV_tfkeras    := TF_USE_LEGACY_KERAS=1
# Both Keras 2 legs prove their versions of the keras2 and legacy families;
# the window contract tests (weighted windows, flush, resume, accumulation
# schedules, BatchNorm across micro-batches) of each family run in one of them: the legacy family's in
# tf215, beside tensorflow-addons (time budget).
ARGS_tfkeras   := $(TF1_TESTS) --leave-out legacy,windows

# TensorFlow 2.15 has wheels for Python 3.9-3.11 only.
DIR_tf215      := $(VENVS)/tf215
PYTHON_tf215   := $(PYTHON)
EXTRAS_tf215   := test,addons
PINS_tf215     := tensorflow==2.15.1 tensorflow-addons==0.23.0 numpy<2
ENV_tf215      :=
# (The Keras 2 new API's window contract tests run in tfkeras, on tf_keras 2.21;
# so do the Keras 2 families' multi-worker processes, keras2/test_multiworker.py.)
ARGS_tf215     := --leave-out keras2,windows --leave-out multiworker

# Keras 3 on JAX and torch: the tests written once with keras.ops and NumPy
# (tests/backends/, and keras-hub's tasks, tests/clients/; k3 runs them on
# TensorFlow), in venvs without TensorFlow, the framework-free core and the references.
DIR_k3-jax      := $(VENVS)/k3-jax
PYTHON_k3-jax   := $(PYTHON)
EXTRAS_k3-jax   := test,keras3,plan
PINS_k3-jax     := keras==3.15.* jax[cpu]==0.10.* $(KERAS_HUB_DEPS)
NODEPS_k3-jax   := $(KERAS_HUB)
ENV_k3-jax      := KERAS_BACKEND=jax
ARGS_k3-jax     := tests/backends tests/clients tests/docs $(EVERY_LEG)

DIR_k3-torch    := $(VENVS)/k3-torch
PYTHON_k3-torch := $(PYTHON)
EXTRAS_k3-torch := test,keras3,plan
# torch 2.13.0: the CPU build these machines keep on disk (1.1 GB venv, under a
# minute); any other torch from the index is a CUDA build of 5.5 GB.
PINS_k3-torch   := keras==3.15.* torch==2.13.0 $(KERAS_HUB_DEPS)
NODEPS_k3-torch := $(KERAS_HUB)
ENV_k3-torch    := KERAS_BACKEND=torch
ARGS_k3-torch   := tests/backends tests/clients tests/docs $(EVERY_LEG)

.PHONY: venv venvs demo test test-full test-nightly bench docs venv-docs clean \
	$(addprefix venv-,$(ALL_LEGS)) $(addprefix test-,$(ALL_LEGS))

# A leg's stamp is named after a checksum of its Python, extras and pins
# (NODEPS too), so
# changing a pin reinstalls that leg (and only it); editing pyproject.toml
# reinstalls every leg.
define LEG_RULES
STAMP_$(1) := $$(DIR_$(1))/.installed-$$(shell printf '%s' "$$(PYTHON_$(1)) $$(EXTRAS_$(1)) $$(PINS_$(1))$$(if $$(NODEPS_$(1)), --no-deps $$(NODEPS_$(1)))" | cksum | cut -d' ' -f1)

$$(STAMP_$(1)): pyproject.toml
	rm -f $$(DIR_$(1))/.installed*
	$$(PYTHON_$(1)) -m venv $$(DIR_$(1))
	$$(DIR_$(1))/bin/python -m pip install --quiet --upgrade pip
	$$(DIR_$(1))/bin/python -m pip install --quiet -e '.[$$(EXTRAS_$(1))]' $$(foreach p,$$(PINS_$(1)),'$$(p)')
	$$(if $$(NODEPS_$(1)),$$(DIR_$(1))/bin/python -m pip install --quiet --no-deps $$(foreach p,$$(NODEPS_$(1)),'$$(p)'))
	touch $$@

venv-$(1): $$(STAMP_$(1))

test-$(1): $$(STAMP_$(1))
	@echo "==== leg $(1): $$(PINS_$(1)) $$(ENV_$(1))"
	env -u TF_USE_LEGACY_KERAS KERAS_BACKEND=tensorflow $$(ENV_$(1)) \
	  ACCUM_LEG=$(1) ACCUM_LEG_PINS='$$(strip $$(PINS_$(1)) $$(NODEPS_$(1)))' ACCUM_PASSED_OUT=$(VENVS)/.passed-$(1).txt \
	  $$(DIR_$(1))/bin/python -m pytest $$(ARGS_$(1)) $$(PYTEST_ARGS)
endef
$(foreach leg,$(sort $(ALL_LEGS) $(LEGS)),$(eval $(call LEG_RULES,$(leg))))

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
venvs: $(addprefix venv-,$(LEGS))

## Train the digits CNN three ways and compare them (see README).
demo: $(STAMP_k3)
	$(DIR_k3)/bin/python examples/digits_demo.py $(DEMO_ARGS)

## The test suite in every leg, one after the other, with the bounded CI
## hypothesis profile, then the docs build; fails if any leg (or the docs)
## fails, after running them all.
test:
	@mkdir -p $(VENVS); rm -rf $(VENVS)/.passed-*.txt $(VENVS)/.result-* $(VENVS)/.install.lock; \
	run_leg() { \
	  leg=$$1; log=$(VENVS)/.test-$$leg.log; start=$$SECONDS; \
	  until mkdir $(VENVS)/.install.lock 2>/dev/null; do sleep 2; done; \
	  $(MAKE) --no-print-directory venv-$$leg > $$log 2>&1; irc=$$?; rmdir $(VENVS)/.install.lock; \
	  if [ $$irc -ne 0 ]; then echo "$$leg: install FAILED" > $(VENVS)/.result-$$leg; cat $$log; return; fi; \
	  mid=$$SECONDS; \
	  if [ "$$2" = live ]; then $(MAKE) --no-print-directory test-$$leg 2>&1 | tee -a $$log; rc=$${PIPESTATUS[0]}; \
	  else $(MAKE) --no-print-directory test-$$leg >> $$log 2>&1; rc=$$?; cat $$log; fi; \
	  line=$$(grep -E '^(=+ )?[0-9a-z ,]*(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' $$log | tail -n 1 | sed -E 's/^=+ | =+$$//g'); \
	  [ $$rc -eq 0 ] && result=ok || result=FAILED; \
	  echo "$$leg: $$result ($${line:-no pytest summary}); install $$((mid-start)) s, tests $$((SECONDS-mid)) s" > $(VENVS)/.result-$$leg; \
	  if [ "$(TEST_KEEP_VENVS)" = no ]; then \
	    case $$leg in $(foreach leg,$(sort $(ALL_LEGS) $(LEGS)),$(leg)$(rparen) rm -rf $(DIR_$(leg));;) esac; \
	    echo "$$leg: venv removed (TEST_KEEP_VENVS=no); $$(df -h --output=avail . | tail -n 1 | tr -d ' ') free"; \
	  fi; \
	}; \
	lane1=""; lane2=""; \
	for leg in $(LEGS); do \
	  if [ "$(TEST_LANES)" -ge 2 ] && [[ " $(LANE1_LEGS) " == *" $$leg "* ]]; then lane1+=" $$leg"; else lane2+=" $$leg"; fi; \
	done; \
	if [ -n "$$lane1" ]; then \
	  echo "==== two lanes at once: [$$lane1 ] (shown live) and [$$lane2 ] (each leg's log shown when it ends)"; \
	  ( for leg in $$lane1; do run_leg $$leg live; done ) & ( for leg in $$lane2; do run_leg $$leg; done ) & wait; \
	else for leg in $$lane2; do run_leg $$leg live; done; fi; \
	failed=0; summary=""; \
	for leg in $(LEGS); do \
	  r=$$(cat $(VENVS)/.result-$$leg 2>/dev/null || echo "$$leg: no result"); summary+="$$r"$$'\n'; \
	  [[ "$$r" == "$$leg: ok ("* ]] || failed=$$((failed+1)); \
	done; \
	legs=$(words $(LEGS)); \
	if [ -n "$(TEST_DOCS)" ]; then \
	  legs=$$((legs+1)); start=$$SECONDS; \
	  if $(MAKE) --no-print-directory venv-docs; then \
	    mid=$$SECONDS; echo "==== docs: mkdocs build --strict"; \
	    $(MAKE) --no-print-directory docs 2>&1 | tee $(VENVS)/.docs.log; rc=$${PIPESTATUS[0]}; \
	    [ $$rc -eq 0 ] && result=ok || { result=FAILED; failed=$$((failed+1)); }; \
	    summary+="docs: $$result; install $$((mid-start)) s, build $$((SECONDS-mid)) s"$$'\n'; \
	  else failed=$$((failed+1)); summary+="docs: install FAILED"$$'\n'; fi; \
	fi; \
	if [ "$(LEGS)" = "$(ALL_LEGS)" ] && [ -z "$(PYTEST_ARGS)" ]; then \
	  legs=$$((legs+1)); echo "==== feature table: every 'yes' cell's test passed in some leg"; \
	  if $(PYTHON) tests/support/features.py --check $(addprefix $(VENVS)/.passed-,$(addsuffix .txt,$(ALL_LEGS))); \
	  then summary+="feature table: ok"$$'\n'; else failed=$$((failed+1)); summary+="feature table: FAILED"$$'\n'; fi; \
	fi; \
	echo "==== make test: one line per leg"; printf '%s' "$$summary"; \
	echo "legs: $$(( legs - failed )) passed, $$failed failed"; \
	[ $$failed -eq 0 ]

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
bench: $(STAMP_k3)
	$(DIR_k3)/bin/python -m benchmarks $(BENCH_ARGS) --out $(BENCH_OUT)
	$(DIR_k3)/bin/python -m benchmarks.memory --models transformer_big --out $(BENCH_OUT)/large

clean:
	rm -rf $(VENV) $(VENVS) demo_output bench_output site .pytest_cache .hypothesis
