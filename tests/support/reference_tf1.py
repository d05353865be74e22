"""The independent reference for TF1 graph code: the same graph, initial values
and sample order, trained with batch N*B by the plain inner optimizer.

Every graph here is built in its own ``tf.Graph`` (nothing leaks into the
eager tests), from initial values that are numpy arrays, so the accumulating
graph and the reference graph start bitwise equal. The accumulating run feeds
the N*B samples of each large batch as N consecutive micro-batches of B; the
loss is a mean over its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from accum_optimizer.families.tf1 import AccumulatingOptimizer
from support import arrays

tf1 = tf.compat.v1

IN, OUT = 4, 3

# Each inner optimizer factory takes the graph's global_step (AdagradDA needs
# it; the others ignore it).
INNER_OPTIMIZERS: dict[str, Callable[[Any], tf1.train.Optimizer]] = {
    "GradientDescent": lambda gs: tf1.train.GradientDescentOptimizer(0.1),
    "Momentum": lambda gs: tf1.train.MomentumOptimizer(0.1, 0.9),
    "Momentum-nesterov": lambda gs: tf1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "Adam": lambda gs: tf1.train.AdamOptimizer(0.02),
    # The user code: a schedule on global_step (counts updates).
    "Adam-exponential_decay": lambda gs: tf1.train.AdamOptimizer(
        tf1.train.exponential_decay(0.05, gs, decay_steps=1, decay_rate=0.5)
    ),
    "Adagrad": lambda gs: tf1.train.AdagradOptimizer(0.1),
    "AdagradDA": lambda gs: tf1.train.AdagradDAOptimizer(
        0.1, gs, l1_regularization_strength=0.001, l2_regularization_strength=0.001
    ),
    "Adadelta": lambda gs: tf1.train.AdadeltaOptimizer(1.0),
    "RMSProp": lambda gs: tf1.train.RMSPropOptimizer(0.01),
    "RMSProp-centered": lambda gs: tf1.train.RMSPropOptimizer(0.01, centered=True),
    "RMSProp-momentum": lambda gs: tf1.train.RMSPropOptimizer(0.01, momentum=0.9),
    "Ftrl": lambda gs: tf1.train.FtrlOptimizer(
        0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.001
    ),
    "ProximalGradientDescent": lambda gs: tf1.train.ProximalGradientDescentOptimizer(
        0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.001
    ),
    "ProximalAdagrad": lambda gs: tf1.train.ProximalAdagradOptimizer(
        0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.001
    ),
}


@contextlib.contextmanager
def control_flow(mode: str):
    """``"v2"``: TF2's defaults in a ``tf.Graph`` (resource variables,
    ``cond_v2``). ``"v1"``: what ``tf.compat.v1.disable_v2_behavior()`` gives
    graph code (``RefVariable``s, control flow v1), restored afterwards."""
    if mode == "v2":
        yield
        return
    assert mode == "v1", mode
    resource, cf2 = tf1.resource_variables_enabled(), tf1.control_flow_v2_enabled()
    tf1.disable_resource_variables()
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        if resource:
            tf1.enable_resource_variables()
        if cf2:
            tf1.enable_control_flow_v2()


def mlp_init(seed: int = 0, vgg: bool = False) -> dict[str, np.ndarray]:
    """Initial values of the model, by variable name: a softmax regression
    ``dense`` (kernel and bias); with ``vgg``, a frozen tanh feature layer
    ``VGG/kernel`` in front (the design document's case)."""
    rng = np.random.default_rng(seed)
    init = {}
    if vgg:
        init["VGG/kernel"] = rng.normal(size=(IN, IN)).astype("float32")
    init["dense/kernel"] = (rng.normal(size=(IN, OUT)) * 0.7).astype("float32")
    init["dense/bias"] = (rng.normal(size=(OUT,)) * 0.1).astype("float32")
    return init


def mlp_data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype("float32")
    y = np.eye(OUT, dtype="float32")[rng.integers(0, OUT, size=n)]
    return x, y


@dataclasses.dataclass
class Mlp:
    """The model's variables (by name), placeholders and mean loss."""

    variables: dict
    x: Any
    y: Any
    loss: Any

    def feed(self, x: np.ndarray, y: np.ndarray) -> dict:
        return {self.x: x, self.y: y}


def mlp_loss(variables: dict, x: Any, y: Any, stop: tuple = ()) -> Any:
    """Mean softmax cross-entropy of the MLP; variables named in ``stop``
    enter through ``tf.stop_gradient`` (they get no gradient from this loss)."""

    def var(name):
        v = variables[name]
        return tf.stop_gradient(v) if name in stop else v

    h = x
    if "VGG/kernel" in variables:
        h = tf.tanh(tf.matmul(h, var("VGG/kernel")))
    logits = tf.matmul(h, var("dense/kernel")) + var("dense/bias")
    return tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(labels=y, logits=logits))


def build_mlp(init: dict) -> Mlp:
    """Variables with the given initial values (in the current graph), and the
    loss on a placeholder batch."""
    variables = {name: tf1.Variable(value, name=name) for name, value in init.items()}
    x = tf1.placeholder(tf.float32, [None, IN], name="x")
    y = tf1.placeholder(tf.float32, [None, OUT], name="y")
    return Mlp(variables, x, y, mlp_loss(variables, x, y))


def values(sess: Any, variables: list) -> dict[str, np.ndarray]:
    """``{name: value}`` of ``variables`` (names without ``:0``)."""
    fetched = sess.run(list(variables))
    return {v.name.split(":")[0]: np.array(a) for v, a in zip(variables, fetched)}


def model_and_inner_state(sess: Any, mlp: Mlp, inner: tf1.train.Optimizer, global_step: Any) -> dict:
    """Every value the large batch determines: the model's variables, every
    variable of the inner optimizer (slots, beta powers) and global_step."""
    return values(sess, list(mlp.variables.values()) + list(inner.variables()) + [global_step])


def train_mlp(inner_name: str | Callable, n: int | None, micro_batch: int, updates: int, reduction: str = "mean",
              init: dict | None = None, data: tuple | None = None, var_filter: Callable | None = None,
              mode: str = "v2", every_update: bool = False) -> dict:
    """Train the MLP for ``updates`` updates and return
    :func:`model_and_inner_state`.

    ``n=None``: the reference, the plain inner optimizer on batches of
    ``micro_batch`` (pass ``N*B``). Otherwise ``AccumulatingOptimizer(inner,
    n)`` on micro-batches of ``micro_batch`` (``n * updates`` runs).
    ``inner_name``: a name of :data:`INNER_OPTIMIZERS`, or a factory taking
    the graph's global step. ``every_update``: return ``{"trajectory": [the
    state after each update], "micro_steps": the wrapper's count or None}``.
    """
    init = init or mlp_init()
    runs = updates * (n or 1)
    x, y = data or mlp_data(runs * micro_batch)
    with control_flow(mode), tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(init)
        global_step = tf1.train.get_or_create_global_step()
        make_inner = INNER_OPTIMIZERS[inner_name] if isinstance(inner_name, str) else inner_name
        inner = make_inner(global_step)
        opt = inner if n is None else AccumulatingOptimizer(inner, n, reduction=reduction)
        var_list = None
        if var_filter is not None:
            var_list = [v for v in tf1.trainable_variables() if var_filter(v)]
        train_op = opt.minimize(mlp.loss, global_step=global_step, var_list=var_list)
        sess.run(tf1.global_variables_initializer())
        trajectory = []
        for k in range(runs):
            batch = slice(k * micro_batch, (k + 1) * micro_batch)
            sess.run(train_op, mlp.feed(x[batch], y[batch]))
            if every_update and (k + 1) % (n or 1) == 0:
                trajectory.append(model_and_inner_state(sess, mlp, inner, global_step))
        if every_update:
            return {"trajectory": trajectory, "micro_steps": None if n is None else int(sess.run(opt.micro_steps))}
        return model_and_inner_state(sess, mlp, inner, global_step)


def max_abs_diff(a: dict, b: dict) -> float:
    """:func:`support.arrays.max_abs_diff` over two dicts of the same keys."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return arrays.max_abs_diff([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])


def assert_close(actual: dict, expected: dict, tol: float = 1e-5) -> float:
    """Same keys; every value within ``tol`` (absolute). Returns the max difference."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for k in expected:
        np.testing.assert_allclose(actual[k], expected[k], rtol=0, atol=tol, err_msg=k)
    return max_abs_diff(actual, expected)


def assert_bitwise(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for k in expected:
        np.testing.assert_array_equal(actual[k], expected[k], err_msg=k)


def equivalence_table(n: int = 3, micro_batch: int = 4, updates: int = 3, modes=("v2", "v1")) -> list:
    """``(mode, optimizer, max |difference|)`` between the wrapper and the
    large batch, as test_tf1's equivalence tests measure it."""
    rows = []
    for mode in modes:
        for name in INNER_OPTIMIZERS:
            expected = train_mlp(name, None, n * micro_batch, updates, mode=mode)
            actual = train_mlp(name, n, micro_batch, updates, mode=mode)
            rows.append((mode, name, max_abs_diff(actual, expected)))
    return rows


if __name__ == "__main__":
    # PYTHONPATH=.:tests python tests/support/reference_tf1.py: the figures the README quotes.
    for mode, name, diff in equivalence_table():
        print(f"{mode}  {name:26s} {diff:.2e}", flush=True)
