"""Keras 3's wrapper on whichever backend runs (``KERAS_BACKEND``): TensorFlow
in the k3 leg, JAX in k3-jax, torch in k3-torch.

Written once with ``keras.ops`` and NumPy. Every check is against an
independent reference: the plain inner optimizer trained on the large batch
(``fit(batch_size=N*B)``), or the plain inner optimizer's ``apply`` with the
window's gradient computed here by hand (``Σ cᵢ·gᵢ / Σ cᵢ``), within 1e-5 in
float32; bitwise where nothing may move (between updates, N = 1, resume).

Custom loops run each backend's own way: ``optimizer.apply`` (TensorFlow and
torch eagerly, JAX eagerly) and, on JAX, ``optimizer.stateless_apply``
inside ``jax.jit`` as Keras' JAX guide writes it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3."):
    pytest.skip(f"Keras 3 only (this is Keras {keras.__version__})", allow_module_level=True)

if keras.backend.backend() == "tensorflow":
    # Where TensorFlow is installed, only where the Keras 3 family is the
    # active Keras (tf.keras is Keras 3: not under TF_USE_LEGACY_KERAS).
    from support.families import require

    require("keras3")

from keras import ops  # noqa: E402

from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow  # noqa: E402
from support.arrays import assert_bitwise_equal, max_abs_diff  # noqa: E402

BACKEND = keras.backend.backend()
TOL = 1e-5
N, B = 3, 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 5)).astype("float32")
Y = RNG.normal(size=(48, 1)).astype("float32")
W = RNG.uniform(0.2, 2.0, size=(48,)).astype("float32")


def make_model(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def fit(optimizer, batch_size: int, epochs: int = 2, x=X, y=Y, loss="mse", model=None, **kwargs) -> keras.Model:
    model = model or make_model()
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    return model


def values(variables) -> list:
    return [np.array(ops.convert_to_numpy(v)) for v in variables]


# ----------------------------------------------------------- the large batch
OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.001),
    "Lion": lambda: keras.optimizers.Lion(0.001),
    "Lamb": lambda: keras.optimizers.Lamb(0.01),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
    # Once per update, on the window gradient: a schedule, weight decay,
    # EMA with overwrite, clipping.
    "Adam+schedule+decay+EMA+clipnorm": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5), weight_decay=0.1, use_ema=True,
        ema_momentum=0.5, ema_overwrite_frequency=3, clipnorm=0.05,
    ),
    "SGD+global_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.05),
    "SGD+clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_trains_like_the_large_batch(name):
    make = OPTIMIZERS[name]
    reference = fit(make(), N * B)
    accumulated = fit(AccumulatingOptimizer(make(), N), B)
    diff = max_abs_diff(reference.get_weights(), accumulated.get_weights())
    moved = max_abs_diff(reference.get_weights(), make_model().get_weights())
    print(f"BACKEND_TABLE {BACKEND} {name} {diff:.3g}")
    assert diff <= TOL, (name, diff)
    assert moved > 100 * TOL, "the reference must move for the comparison to mean anything"
    opt = accumulated.optimizer
    assert int(ops.convert_to_numpy(opt.micro_steps)) == 2 * len(X) // B
    assert int(ops.convert_to_numpy(opt.iterations)) == 2 * len(X) // (N * B)
    assert int(ops.convert_to_numpy(opt.iterations)) == int(ops.convert_to_numpy(reference.optimizer.iterations))


def test_pass_through_at_one_is_bitwise_the_plain_optimizer():
    plain = fit(keras.optimizers.Adam(0.01), B)
    wrapped = fit(AccumulatingOptimizer(keras.optimizers.Adam(0.01), 1), B)
    assert_bitwise_equal(plain.get_weights(), wrapped.get_weights(), "weights")
    assert_bitwise_equal(values(plain.optimizer.variables), values(wrapped.optimizer.inner_optimizer.variables))


# -------------------------------------------------------------- custom loops
class Loop:
    """One model, one optimizer, micro-steps taken the backend's way:
    ``mode="eager"`` calls ``optimizer.apply``; ``mode="jit"`` (JAX) calls
    ``optimizer.stateless_apply`` inside ``jax.jit`` and keeps the state in
    arrays, written back to the variables by :meth:`sync`."""

    def __init__(self, optimizer, mode: str, dtype: str = "float32"):
        self.model = make_model()
        self.variables = [keras.Variable(ops.cast(v, dtype), dtype=dtype) for v in self.model.trainable_variables]
        self.optimizer = optimizer
        self.mode = mode
        optimizer.build(self.variables)
        if mode == "jit":
            import jax

            self._step = jax.jit(
                lambda opt_vars, grads, train_vars, weight: optimizer.stateless_apply(
                    opt_vars, grads, train_vars, weight=weight
                ),
                static_argnums=(),
            )
            self._step_unweighted = jax.jit(
                lambda opt_vars, grads, train_vars: optimizer.stateless_apply(opt_vars, grads, train_vars)
            )
            self.state = ([v.value for v in optimizer.variables], [v.value for v in self.variables])

    def step(self, grads, weight=None):
        if self.mode == "eager":
            self.optimizer.apply(grads, self.variables, weight=weight)
            return
        opt_vars, train_vars = self.state
        if weight is None:
            train_vars, opt_vars = self._step_unweighted(opt_vars, grads, train_vars)
        else:
            train_vars, opt_vars = self._step(opt_vars, grads, train_vars, weight)
        self.state = (opt_vars, train_vars)

    def flush(self):
        """The partial window applied now: ``flush()``, or under ``jit``
        ``stateless_flush`` on the arrays, written back."""
        if self.mode == "eager":
            self.optimizer.flush()
            return
        import jax

        opt_vars, train_vars = self.state
        train_vars, opt_vars = jax.jit(self.optimizer.stateless_flush)(opt_vars, train_vars)
        self.state = (opt_vars, train_vars)
        self.sync()

    def sync(self):
        if self.mode == "jit":
            opt_vars, train_vars = self.state
            for v, x in zip(self.optimizer.variables, opt_vars):
                v.assign(x)
            for v, x in zip(self.variables, train_vars):
                v.assign(x)


MODES = ["eager"] + (["jit"] if BACKEND == "jax" else [])


def grads_like(variables, seed: int, scale: float = 1.0, dtype: str = "float32") -> list:
    rng = np.random.default_rng(seed)
    return [(scale * rng.normal(size=tuple(v.shape))).astype(dtype) for v in variables]


def loop_and_reference(make_inner, mode, steps=N, dtype="float32", **kwargs):
    """A :class:`Loop` around ``AccumulatingOptimizer(make_inner(), steps,
    **kwargs)`` and the reference: copies of its starting variables and a
    plain ``make_inner()`` built on them."""
    loop = Loop(AccumulatingOptimizer(make_inner(), steps, **kwargs), mode, dtype=dtype)
    # Copies (through NumPy): on torch `keras.Variable(v.value)` shares v's
    # storage, and the reference would then be the loop's own variables.
    ref_vars = [keras.Variable(np.array(ops.convert_to_numpy(v))) for v in loop.variables]
    assert not any(np.shares_memory(ops.convert_to_numpy(r), ops.convert_to_numpy(v))
                   for r, v in zip(ref_vars, loop.variables))
    reference = make_inner()
    reference.build(ref_vars)
    return loop, ref_vars, reference


def plain_step(optimizer, variables, grads):
    """The reference: the plain optimizer's own ``apply`` (``None`` entries
    and their variables left out, as Keras does)."""
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    optimizer.apply([ops.convert_to_tensor(g) for g, _ in pairs], [v for _, v in pairs])


def window_and_reference(loop, reference, ref_vars, micro) -> None:
    """The micro-steps ``micro`` (a window of ``len(micro)``) through the
    loop, and the reference's plain update with the window gradient: per
    variable ``Σ gᵢ / len(micro)`` over the micro-steps that had one,
    ``None`` where none had (``docs/semantics.md``, missing gradients)."""
    for g in micro:
        loop.step(g)
    loop.sync()
    window = []
    for i in range(len(ref_vars)):
        received = [m[i] for m in micro if m[i] is not None]
        window.append(sum(received) / len(micro) if received else None)
    plain_step(reference, ref_vars, window)


@pytest.mark.parametrize("mode", MODES)
def test_custom_loop_window_is_the_mean_and_nothing_moves_between_updates(mode):
    loop, ref_vars, reference = loop_and_reference(lambda: keras.optimizers.Adam(0.05, weight_decay=0.1), mode)
    state = lambda: values(loop.variables) + values(loop.optimizer.inner_optimizer.variables)  # noqa: E731
    for window in range(2):
        micro = [grads_like(ref_vars, 10 * window + i) for i in range(N)]
        start = state()
        for i, g in enumerate(micro):
            loop.step(g)
            loop.sync()
            if i < N - 1:  # accumulate-only: weights and the inner optimizer bitwise as at the window's start
                assert_bitwise_equal(start, state(), "between updates")
        plain_step(reference, ref_vars, [sum(gs) / N for gs in zip(*micro)])
        assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    assert int(ops.convert_to_numpy(loop.optimizer.iterations)) == 2
    assert int(ops.convert_to_numpy(loop.optimizer.micro_steps)) == 2 * N


@pytest.mark.parametrize("mode", MODES)
def test_missing_gradients_leave_a_variable_untouched_and_gate_the_closing_micro_step(mode):
    loop, ref_vars, reference = loop_and_reference(lambda: keras.optimizers.Adam(0.05, weight_decay=0.1), mode)
    last = len(ref_vars) - 1
    # Window 1: the last variable never gets a gradient: not updated, not decayed.
    micro = [grads_like(ref_vars, i) for i in range(N)]
    for g in micro:
        g[last] = None
    window_and_reference(loop, reference, ref_vars, micro)
    # Window 2: it gets one on the first two micro-steps, none on the closing one.
    micro = [grads_like(ref_vars, 10 + i) for i in range(N)]
    micro[-1][last] = None
    window_and_reference(loop, reference, ref_vars, micro)
    assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    assert max_abs_diff(values(reference.variables), values(loop.optimizer.inner_optimizer.variables)) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_a_variable_without_gradient_on_the_closing_micro_step_is_decayed_and_one_without_any_is_untouched(mode):
    """AdamW's weight decay acts on every variable the window updates, also
    one whose gradient is ``None`` on the closing micro-step (a multi-task
    model trained on one head per micro-batch); a variable with no gradient
    in the whole window is neither decayed nor moved by its non-zero Adam
    moments. Against the plain AdamW's ``apply`` of the window gradient
    (``Σ gᵢ / N`` over the micro-steps that had one, ``docs/semantics.md``),
    which leaves out a variable whose gradient is ``None``, as Keras does."""
    loop, ref_vars, reference = loop_and_reference(lambda: keras.optimizers.AdamW(0.05, weight_decay=0.2), mode)
    b = 0  # the first kernel: non-zero, so that its decay shows
    assert np.abs(values(ref_vars)[b]).min() > 0
    # Window 1: b gets gradients on micro-steps 1 and 2, none on 3.
    micro = [grads_like(ref_vars, i) for i in range(N)]
    micro[-1][b] = None
    window_and_reference(loop, reference, ref_vars, micro)
    assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    # Window 2: b gets none: not decayed, not moved by its momentum.
    micro = [grads_like(ref_vars, 10 + i) for i in range(N)]
    for g in micro:
        g[b] = None
    before = values(loop.variables)[b]
    window_and_reference(loop, reference, ref_vars, micro)
    assert_bitwise_equal([before], [values(loop.variables)[b]], "a variable without gradients in the window")
    assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    assert max_abs_diff(values(reference.variables), values(loop.optimizer.inner_optimizer.variables)) <= TOL


DECAYING = {
    "AdamW": lambda: keras.optimizers.AdamW(0.05),  # its default weight_decay (0.004)
    "SGD+weight_decay": lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(DECAYING))
def test_flush_with_weight_decay_is_the_plain_update_of_the_partial_window(name, mode):
    """A full window, then a partial one of 2 micro-steps flushed: two plain
    updates with the windows' means, weight decay included."""
    loop, ref_vars, reference = loop_and_reference(DECAYING[name], mode)
    micro = [grads_like(ref_vars, i) for i in range(N + 2)]
    for g in micro:
        loop.step(g)
    loop.flush()
    for window in (micro[:N], micro[N:]):
        plain_step(reference, ref_vars, [sum(gs) / len(window) for gs in zip(*window)])
    assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    assert int(ops.convert_to_numpy(loop.optimizer.iterations)) == 2
    assert int(ops.convert_to_numpy(loop.optimizer.mini_step)) == 0


@pytest.mark.parametrize("mode", MODES)
def test_weighted_window_and_sum_reduction(mode):
    for reduction in ("mean", "sum"):
        loop, ref_vars, reference = loop_and_reference(
            lambda: keras.optimizers.SGD(0.1, momentum=0.9), mode, reduction=reduction)
        for window in range(2):
            micro = [grads_like(ref_vars, 10 * window + i) for i in range(N)]
            counts = [3.0, 0.5, 2.0] if reduction == "mean" else [None] * N
            for g, c in zip(micro, counts):
                loop.step(g, weight=None if c is None else np.float32(c))
            if reduction == "mean":
                window_grads = [sum(c * g[i] for c, g in zip(counts, micro)) / sum(counts) for i in range(len(ref_vars))]
            else:
                window_grads = [sum(g[i] for g in micro) for i in range(len(ref_vars))]
            plain_step(reference, ref_vars, window_grads)
        loop.sync()
        assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL, reduction


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_schedule_and_flush(mode):
    schedule = {0: 2, 2: 3}  # updates 0 and 1: N = 2; then N = 3
    loop, ref_vars, reference = loop_and_reference(lambda: keras.optimizers.Adam(0.05), mode, steps=schedule)
    seed = 0
    for n in (2, 2, 3):
        micro = [grads_like(ref_vars, seed + i) for i in range(n)]
        seed += n
        for g in micro:
            loop.step(g)
        plain_step(reference, ref_vars, [sum(gs) / n for gs in zip(*micro)])
    micro = [grads_like(ref_vars, 100 + i) for i in range(2)]  # a partial window of 2
    for g in micro:
        loop.step(g)
    loop.flush()
    plain_step(reference, ref_vars, [sum(gs) / 2 for gs in zip(*micro)])
    assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL
    assert int(ops.convert_to_numpy(loop.optimizer.iterations)) == 4
    assert int(ops.convert_to_numpy(loop.optimizer.mini_step)) == 0


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_policies(mode):
    for policy in ("skip_micro_step", "skip_window"):
        loop, ref_vars, reference = loop_and_reference(lambda: keras.optimizers.SGD(0.1), mode, nonfinite=policy)
        micro = [grads_like(ref_vars, i) for i in range(N + 1)]
        bad = grads_like(ref_vars, 99)
        bad[0][0, 0] = np.nan
        loop.step(micro[0])
        loop.step(bad)
        for g in micro[1:]:
            loop.step(g)
        loop.sync()
        if policy == "skip_micro_step":  # dropped: the window took micro[0..2], micro[3] starts the next
            plain_step(reference, ref_vars, [sum(gs) / N for gs in zip(*micro[:N])])
            assert int(ops.convert_to_numpy(loop.optimizer.skipped_micro_steps)) == 1
        else:  # the window of micro[0], bad, micro[1] is discarded; micro[2], micro[3] are in the next
            assert int(ops.convert_to_numpy(loop.optimizer.skipped_windows)) == 1
            assert int(ops.convert_to_numpy(loop.optimizer.iterations)) == 0
        assert max_abs_diff(values(ref_vars), values(loop.variables)) <= TOL, policy


@pytest.mark.parametrize("mode", MODES)
def test_float16_variables_accumulate_in_float32(mode):
    loop = Loop(AccumulatingOptimizer(keras.optimizers.SGD(1.0), N), mode, dtype="float16")
    assert {keras.backend.standardize_dtype(a.dtype) for a in loop.optimizer.acc_grads} == {"float32"}
    start = values(loop.variables)
    # 3 micro-steps of 2**-12 on top of 1: each is lost in a float16 running
    # sum (1 + 2**-12 rounds to 1), kept in float32.
    micro = [[np.full(tuple(v.shape), 1.0 if i == 0 else 2.0**-12, "float16") for v in loop.variables]
             for i in range(N)]
    for g in micro:
        loop.step(g)
    loop.sync()
    window = [(np.float32(1.0) + 2 * np.float32(2.0**-12)) / np.float32(N)] * len(start)
    expected = [(s.astype(np.float32) - w).astype(np.float16) for s, w in zip(start, window)]
    assert_bitwise_equal(expected, values(loop.variables))


# ------------------------------------------------------------ fit's windows
FLUSHED = {
    "Adam": lambda: keras.optimizers.Adam(0.01),
    "AdamW": lambda: keras.optimizers.AdamW(0.01),  # its default weight_decay (0.004)
    "SGD+weight_decay": lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.2),
}


@pytest.mark.parametrize("name", sorted(FLUSHED))
def test_flush_partial_window_trains_like_the_large_batch_with_its_last_smaller_batch(name):
    x, y = X[:40], Y[:40]  # 10 micro-batches of 4: 3 windows and one of 1 per epoch
    reference = fit(FLUSHED[name](), N * B, x=x, y=y)
    accumulated = fit(AccumulatingOptimizer(FLUSHED[name](), N), B, x=x, y=y, callbacks=[FlushPartialWindow()])
    assert max_abs_diff(reference.get_weights(), accumulated.get_weights()) <= TOL
    assert int(ops.convert_to_numpy(accumulated.optimizer.iterations)) == 8


def test_the_backends_page_fit_example_trains_like_batch_size_128():
    """``docs/families/backends.md``'s ``fit``: AdamW(1e-3), N = 8,
    ``batch_size=16``, ``FlushPartialWindow``, sparse categorical
    cross-entropy; 208 samples, so each epoch ends on a partial window of 5
    micro-batches (the large batch's last batch of 80)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(208, 5)).astype("float32")
    y = rng.integers(0, 3, size=(208,))

    def model():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3, activation="softmax")])

    def train(optimizer, batch_size, callbacks=()):
        m = model()
        m.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))
        return m

    reference = train(keras.optimizers.AdamW(1e-3), 128)
    accumulated = train(AccumulatingOptimizer(keras.optimizers.AdamW(1e-3), 8), 16, [FlushPartialWindow()])
    assert max_abs_diff(reference.get_weights(), accumulated.get_weights()) <= TOL
    assert int(ops.convert_to_numpy(accumulated.optimizer.iterations)) == 4


def test_counted_loss_weights_the_window_by_sample_weights():
    loss = lambda: CountedLoss("mse", reduction="mean_with_sample_weight")  # noqa: E731
    reference = fit(keras.optimizers.Adam(0.01), N * B, loss=keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"), sample_weight=W)
    accumulated = fit(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), B, loss=loss(), sample_weight=W)
    unweighted = fit(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), B, loss=keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"), sample_weight=W)
    assert max_abs_diff(reference.get_weights(), accumulated.get_weights()) <= TOL
    assert max_abs_diff(reference.get_weights(), unweighted.get_weights()) > 100 * TOL


# ------------------------------------------------------------------- saving
@pytest.mark.parametrize("fmt", ["keras", "weights.h5"])
def test_save_mid_window_and_resume_bitwise(tmp_path, fmt):
    x, y = X[:20], Y[:20]  # 5 micro-batches per epoch: epoch 1 ends mid-window
    straight = fit(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), B, epochs=2, x=x, y=y)
    first = fit(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), B, epochs=1, x=x, y=y)
    assert int(ops.convert_to_numpy(first.optimizer.mini_step)) == 2
    path = str(tmp_path / f"model.{fmt}")
    if fmt == "keras":
        first.save(path)
        resumed = keras.saving.load_model(path)
    else:
        first.save_weights(path)
        resumed = make_model(seed=7)
        resumed.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), loss="mse")
        resumed.load_weights(path)
    assert int(ops.convert_to_numpy(resumed.optimizer.mini_step)) == 2
    resumed.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_bitwise_equal(straight.get_weights(), resumed.get_weights(), "weights")
    assert_bitwise_equal(values(straight.optimizer.variables), values(resumed.optimizer.variables), "state")


def test_config_round_trip():
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01, beta_1=0.8), {0: 2, 4: 3}, reduction="sum",
                                nonfinite="skip_window", accumulator_dtype="float32")
    clone = AccumulatingOptimizer.from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()
    assert float(clone.inner_optimizer.beta_1) == 0.8
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).get_config() == opt.get_config()


# ---------------------------------------------------- one branch, one package
@pytest.mark.skipif(BACKEND != "jax", reason="the inner update under jax.jit: JAX only")
def test_jit_runs_the_inner_update_only_on_updates():
    """The inner optimizer's ``update_step`` runs (a host callback counts it)
    once per variable per update under ``fit``'s ``jit``, not on every
    micro-step; Keras' built-in accumulation runs it on every micro-step
    and keeps the old values (``keras/src/backend/jax/optimizer.py``)."""
    import jax

    calls = []

    class CountingSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            jax.debug.callback(lambda: calls.append(1))
            super().update_step(gradient, variable, learning_rate)

    variables = len(make_model().trainable_variables)
    fit(AccumulatingOptimizer(CountingSGD(0.01), N), B, epochs=1)
    jax.effects_barrier()
    assert len(calls) == variables * len(X) // (N * B)
    calls.clear()
    fit(CountingSGD(0.01, gradient_accumulation_steps=N), B, epochs=1)
    jax.effects_barrier()
    assert len(calls) == variables * len(X) // B


def test_import_loads_no_framework_the_user_did_not_import():
    code = (
        "import sys, accum_optimizer; "
        "print(sorted(m for m in ('tensorflow', 'jax', 'torch', 'keras') if m in sys.modules))"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "keras" in loaded  # (to register the wrapper with Keras' serialization)
    others = {"jax", "torch", "tensorflow"} - {BACKEND}
    assert not (set(loaded) & others), loaded


@pytest.mark.skipif(os.environ.get("ACCUM_LEG") not in ("k3-jax", "k3-torch"), reason="the k3-jax and k3-torch legs")
def test_leg_runs_its_backend_without_tensorflow():
    """The leg is what its name says (make test): Keras 3 on its backend,
    pinned as .ci/legs.py installed it, and no TensorFlow installed."""
    import importlib.util
    from importlib import metadata

    from packaging.requirements import Requirement

    assert BACKEND == os.environ["ACCUM_LEG"].split("-")[1]
    assert importlib.util.find_spec("tensorflow") is None
    for pin in os.environ.get("ACCUM_LEG_PINS", "").split():
        requirement = Requirement(pin)
        assert metadata.version(requirement.name) in requirement.specifier, pin


_DATA_PARALLEL = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, keras, numpy as np
from accum_optimizer import AccumulatingOptimizer
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 5)).astype("float32"); y = rng.normal(size=(48, 1)).astype("float32")
def run(optimizer, batch_size, distribution):
    keras.distribution.set_distribution(distribution)  # before any variable (the optimizer's too)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer(), "mse")
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), len(jax.devices())
ref, _ = run(lambda: keras.optimizers.Adam(0.01), 12, None)
acc, devices = run(lambda: AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3), 4,
                   keras.distribution.DataParallel(devices=jax.devices()))
print(devices, max(float(np.abs(a - b).max()) for a, b in zip(ref, acc)))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.DataParallel over 2 CPU devices: JAX only")
def test_jax_data_parallel_over_two_devices_trains_like_the_single_device_large_batch():
    """``keras.distribution.DataParallel`` over 2 CPU devices
    (``--xla_force_host_platform_device_count=2``, set before JAX starts:
    a fresh process), micro-batches of 4 (2 per device), N = 3, against one
    device's ``fit(batch_size=12)``."""
    out = subprocess.run([sys.executable, "-c", _DATA_PARALLEL], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    devices, diff = out.stdout.split()[-2:]
    assert int(devices) == 2
    assert float(diff) <= TOL, diff


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.ModelParallel over 4 CPU devices: JAX only")
def test_jax_model_parallel_accumulators_have_their_variables_layout():
    """``keras.distribution.ModelParallel`` over a 2x2 mesh of CPU devices
    (``experiments.jax_layouts``, a fresh process), tensor-parallel kernels
    and an FSDP-style layout sharding every kernel over both axes: each
    accumulator has its variable's sharding, each row tracker the
    variable's first-axis sharding, the counters are replicated, the
    accumulators hold one sharded copy of the trainable variables per
    device (the wrapper's state: that, the trackers and the counters), and
    N = 3 micro-batches of 4 train like one device's ``fit(batch_size=12)``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "experiments.jax_layouts", "--json"], capture_output=True,
                         text=True, env=env, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["layout"] for r in results] == ["tensor_parallel", "fsdp"]
    for r in results:
        assert r["devices"] == 4
        kernels = [row for row in r["rows"] if row["variable"].endswith("kernel")]
        assert kernels and all(row["variable_spec"] != "replicated" for row in kernels), r  # (the layout took)
        for row in r["rows"]:
            assert row["acc_grad_same_sharding"], row
            assert row["touched_rows_same_first_axis"] in (True, None), row
        assert r["counters_replicated"], r
        assert r["acc_grad_bytes_per_device"] == r["trainable_bytes_per_device"], r  # (float32 both)
        assert r["own_bytes_per_device"] <= (
            r["trainable_bytes_per_device"] + r["touched_rows_bytes_per_device"] + r["counter_bytes"]
        ), r
        assert r["max_abs_diff"] <= TOL, r


# ---------------------------------------------------------- mixed precision
class dtype_policy:
    def __init__(self, policy):
        self.policy = policy

    def __enter__(self):
        self.previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.policy)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.previous)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_fit_with_a_loss_scale_optimizer_outside_matches_the_large_batch(policy):
    """N = 3, B = 4 against ``fit(batch_size=12)`` under the same policy
    (float16: a ``LossScaleOptimizer`` outside each, scale 2**4, as
    ``compile`` would add), within :func:`support.precision.mixed_precision_tolerance`:
    the first-order effect of gradients that differ by 16-bit rounding."""
    from support.precision import epsilon_16, mixed_precision_tolerance, update_weights_recorder

    x, y = np.concatenate([X, X[::-1]]), np.concatenate([Y, -Y])
    recorder = update_weights_recorder(keras)()

    def wrap(inner):
        if policy != "mixed_float16":
            return inner
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**4)

    with dtype_policy(policy):
        reference = fit(wrap(keras.optimizers.Adam(0.01)), N * B, x=x, y=y, callbacks=[recorder])
        accumulated = fit(wrap(AccumulatingOptimizer(keras.optimizers.Adam(0.01), N)), B, x=x, y=y)
        start = make_model()
    assert reference.layers[0].compute_dtype == policy.split("_")[1]
    opt = accumulated.optimizer.inner_optimizer if policy == "mixed_float16" else accumulated.optimizer
    assert int(ops.convert_to_numpy(opt.iterations)) == 2 * len(x) // (N * B)
    tol = mixed_precision_tolerance(keras.optimizers.Adam(0.01).get_config(), epsilon_16(policy), recorder.history)
    assert max_abs_diff(reference.get_weights(), start.get_weights()) > tol
    assert max_abs_diff(reference.get_weights(), accumulated.get_weights()) <= tol


# Micro-gradients (the inputs of y = w*x with loss mean(y): the gradient of w
# is x): NaN in micro-batch 2 of the first window of 4. SGD(1.0) from w = 0;
# /16 keeps x * 2**15 (the default loss scale) finite in float16.
XS = np.array([1, np.nan, 3, 5, 7, 9, 11, 13], "float32") / 16


def _nan_expected(policy):
    """(w, micro_steps, iterations, skipped_micro_steps, skipped_windows) by hand."""
    if policy in ("propagate", "skip_micro_step"):
        # The LossScaleOptimizer drops micro-batch 2: window 1 is 1, 3, 4, 5.
        return -np.mean(XS[[0, 2, 3, 4]]), 7, 1, (None if policy == "propagate" else 1), (
            None if policy == "propagate" else 0)
    return -np.mean(XS[4:8]), 8, 1, 1, 1  # skip_window: window 1 discarded


@pytest.mark.parametrize("policy", ["propagate", "skip_micro_step", "skip_window"])
def test_micro_step_the_loss_scale_optimizer_skips_follows_the_policy(policy):
    acc = AccumulatingOptimizer(keras.optimizers.SGD(1.0), 4, nonfinite=policy)
    with dtype_policy("mixed_float16"):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=acc, loss=lambda y_true, y_pred: y_pred)  # compile adds the LossScaleOptimizer
        model.fit(XS[:, None], XS[:, None], batch_size=1, shuffle=False, verbose=0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    w, micro_steps, iterations, skipped, windows = _nan_expected(policy)
    count = lambda v: None if v is None else int(ops.convert_to_numpy(v))  # noqa: E731
    np.testing.assert_allclose(ops.convert_to_numpy(model.layers[0].kernel), [[w]], rtol=1e-6)
    assert (count(acc.micro_steps), count(acc.iterations)) == (micro_steps, iterations)
    assert (count(acc.skipped_micro_steps), count(acc.skipped_windows)) == (skipped, windows)
    assert float(ops.convert_to_numpy(model.optimizer.dynamic_scale)) == model.optimizer.initial_scale / 2


@pytest.mark.parametrize("mode", MODES)
def test_bad_weights_are_refused_before_any_state_changes(mode):
    loop = Loop(AccumulatingOptimizer(keras.optimizers.SGD(0.1), N), mode)
    g = grads_like(loop.variables, 0)
    if mode == "eager":
        with pytest.raises(TypeError, match=r"`weight` must be a scalar >= 0 .*Received weight='two'"):
            loop.step(g, weight="two")
        with pytest.raises(ValueError, match=r"`weight` must be a scalar \(one count per micro-step\)"):
            loop.step(g, weight=np.ones(2, "float32"))
    before = values(loop.optimizer.variables)
    # Inside jax.jit the check runs with the step (a host callback) and fails it.
    with pytest.raises(Exception, match=r"`weight` must be finite and >= 0"):
        loop.step(g, weight=np.float32(-1.0))
        loop.sync()
    assert_bitwise_equal(before, values(loop.optimizer.variables), "state after a refused weight")


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow: tests/contract/test_batch_norm.py")
def test_pooled_batch_norm_is_the_parent_here_and_refused_by_an_accumulating_optimizer():
    """On JAX and torch, accum_optimizer.layers.BatchNormalization is the
    parent layer (plain training: bitwise Keras' moving statistics), and an
    accumulating optimizer that would train it says so at build."""
    from accum_optimizer.layers import BatchNormalization

    def model(bn):
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), bn(momentum=0.9), keras.layers.Dense(1)])

    ours, parent = fit(keras.optimizers.SGD(0.01), B, model=model(BatchNormalization)), fit(
        keras.optimizers.SGD(0.01), B, model=model(keras.layers.BatchNormalization))
    assert_bitwise_equal([ops.convert_to_numpy(v) for v in ours.layers[1].weights[:4]],
                         [ops.convert_to_numpy(v) for v in parent.layers[1].weights])
    with pytest.raises(NotImplementedError, match=f"TensorFlow backend only.*{BACKEND}"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.01), N).build(ours.trainable_variables)


# ------------------------------------------- writes through `optimizer.assign*`
class ScatterUpdateOptimizer(keras.optimizers.Optimizer):
    """Keras' own test optimizer of ``optimizer_sparse_test.py``."""

    def __init__(self):
        super().__init__(learning_rate=0.001)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = [self.add_variable_from_reference(v, name="momentum") for v in variables]

    def update_step(self, grad, variable, learning_rate):
        momentum = self.momentums[self._get_variable_index(variable)]
        self.assign(momentum, ops.cast(grad, momentum.dtype))
        self.assign(variable, ops.cast(grad, variable.dtype))


# The 19 cases of Keras' `test_sparse_gradients` (keras/src/optimizers/optimizer_sparse_test.py),
# each the inner optimizer of the wrapper ("loss_scale_optimizer_sgd": the wrapper inside the
# LossScaleOptimizer, which that test unwraps to patch).
KERAS_SPARSE_CASES = {
    "adadelta": lambda: keras.optimizers.Adadelta(),
    "adafactor": lambda: keras.optimizers.Adafactor(clip_threshold=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(),
    "adam": lambda: keras.optimizers.Adam(),
    "adam_amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
    "adamax": lambda: keras.optimizers.Adamax(),
    "adamw": lambda: keras.optimizers.AdamW(),
    "adamw_amsgrad": lambda: keras.optimizers.AdamW(amsgrad=True),
    "ftrl": lambda: keras.optimizers.Ftrl(),
    "lion": lambda: keras.optimizers.Lion(),
    "loss_scale_optimizer_sgd": lambda: keras.optimizers.SGD(learning_rate=0.5),
    "nadam": lambda: keras.optimizers.Nadam(),
    "rmsprop": lambda: keras.optimizers.RMSprop(),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(momentum=0.05),
    "rmsprop_momentum_centered": lambda: keras.optimizers.RMSprop(momentum=0.05, centered=True),
    "sgd": lambda: keras.optimizers.SGD(),
    "sgd_momentum": lambda: keras.optimizers.SGD(momentum=0.05),
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(momentum=0.05, nesterov=True),
    "scatter_update": ScatterUpdateOptimizer,
}


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("sparse", [False, True] if BACKEND == "tensorflow" else [False])
@pytest.mark.parametrize("case", sorted(KERAS_SPARSE_CASES))
def test_writes_go_through_the_optimizers_own_assign_methods(case, sparse, steps):
    """Keras' ``test_sparse_gradients`` mock, with the wrapper as the
    optimizer it patches: ``Variable.assign``/``assign_add``/``assign_sub``
    replaced by a two-argument function that fails on a non-scalar variable,
    the optimizers' ``assign*`` by recorders, ``_apply_weight_decay``
    patched out. One micro-step (N = 2: the wrapper's own writes; N = 1:
    the pass-through): no variable is written by its own method, the
    micro-step counter and (N = 2) the accumulator go through the wrapper's
    ``assign_add``, and the model variable is not written by the wrapper."""
    from unittest import mock

    model_variable = keras.Variable(initializer="ones", shape=(5, 10))
    wrapper = AccumulatingOptimizer(KERAS_SPARSE_CASES[case](), steps)
    optimizer = keras.optimizers.LossScaleOptimizer(wrapper) if case == "loss_scale_optimizer_sgd" else wrapper
    if sparse:
        import tensorflow as tf

        grad = tf.IndexedSlices(0.5 * ops.ones((3, 10)), (0, 2, 4), (5, 10))
    else:
        grad = 0.5 * ops.ones((5, 10))
    variable_class = model_variable._value.__class__ if BACKEND == "tensorflow" else model_variable.__class__
    wrapper.build([model_variable])
    inner = wrapper.inner_optimizer

    def mock_variable_assign(variable, value):
        if len(variable.shape):
            pytest.fail("`assign`, `assign_add` or `assign_sub` called on a variable directly; "
                        "use `self.assign/assign_add/assign_sub(variable, value)`.")

    with mock.patch.object(wrapper, "_apply_weight_decay", autospec=True), \
            mock.patch.object(inner, "_apply_weight_decay", autospec=True), \
            mock.patch.object(wrapper, "assign", autospec=True) as wrapper_assign, \
            mock.patch.object(wrapper, "assign_add", autospec=True) as wrapper_assign_add, \
            mock.patch.object(wrapper, "assign_sub", autospec=True) as wrapper_assign_sub, \
            mock.patch.object(inner, "assign", autospec=True), \
            mock.patch.object(inner, "assign_add", autospec=True), \
            mock.patch.object(inner, "assign_sub", autospec=True), \
            mock.patch.object(variable_class, "assign", autospec=True) as variable_assign, \
            mock.patch.object(variable_class, "assign_add", autospec=True) as variable_assign_add, \
            mock.patch.object(variable_class, "assign_sub", autospec=True) as variable_assign_sub:
        for m in (variable_assign, variable_assign_add, variable_assign_sub):
            m.side_effect = mock_variable_assign
        optimizer.apply([grad], [model_variable])

    def targets(recorder):
        return [call.args[0] for call in recorder.call_args_list]

    # The model variable is the inner optimizer's to write. (Except where the
    # window's `cond` is traced, inside JAX's LossScaleOptimizer: it writes
    # back the whole state it threads through, the model variable unchanged.)
    traced = BACKEND == "jax" and case == "loss_scale_optimizer_sgd"
    written = targets(wrapper_assign) + targets(wrapper_assign_add) + targets(wrapper_assign_sub)
    assert traced or not any(v is model_variable for v in written), "the wrapper wrote the model variable"
    assert any(v is wrapper.micro_steps for v in targets(wrapper_assign_add))
    if steps > 1 and not sparse:  # (a sparse gradient is scattered into the accumulator's tensor)
        assert any(v is wrapper.acc_grads[0] for v in targets(wrapper_assign_add))


# --------------------------------------------------------- a torch custom loop
def torch_loop(model, optimizer, x, y, epochs: int, zero_grad: bool = True) -> None:
    """The custom loop of ``docs/families/backends.md`` (torch)."""
    import torch

    loss_fn = keras.losses.MeanSquaredError()
    for _ in range(epochs):
        for start in range(0, len(x), B):
            xb, yb = torch.from_numpy(x[start:start + B]), torch.from_numpy(y[start:start + B])
            if zero_grad:
                model.zero_grad()
            loss = loss_fn(yb, model(xb, training=True))
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
        optimizer.flush()


@pytest.mark.skipif(BACKEND != "torch", reason="a torch loop: torch only")
def test_torch_custom_loop_of_the_backends_page_trains_like_the_large_batch():
    """N = 3 micro-batches of 4 with ``model.zero_grad()`` before each
    backward pass, ``flush()`` at each epoch's end (40 samples: 3 windows and
    one of 1 micro-batch per epoch), against ``fit(batch_size=12)``; without
    ``zero_grad`` torch sums ``.grad`` across micro-steps and training differs."""
    x, y = X[:40], Y[:40]
    reference = fit(keras.optimizers.Adam(0.01), N * B, x=x, y=y)
    model = make_model()
    torch_loop(model, AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), x, y, epochs=2)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) <= TOL
    summed = make_model()
    torch_loop(summed, AccumulatingOptimizer(keras.optimizers.Adam(0.01), N), x, y, epochs=2, zero_grad=False)
    assert max_abs_diff(reference.get_weights(), summed.get_weights()) > 100 * TOL
