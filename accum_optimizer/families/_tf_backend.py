"""The window algorithm's :class:`~accum_optimizer.core.state.Backend` in
TensorFlow, and the TensorFlow checks every family shares.

:class:`TFBackend` is the core's arithmetic in ``tf`` ops, for all four
families (Keras 3 on TF, Keras 2, legacy ``OptimizerV2``/tensorflow-addons,
TF1). A family subclasses it only where its world differs: how it writes
variables (TF1 graph code returns the ops, to order them by hand) and how it
calls its inner optimizer (``apply_inner``). Sparse gradients are
``tf.IndexedSlices``; per-replica values (``tf.distribute``) are accepted
wherever a gradient is.

The backends, by where they run:

* :class:`TFBackend`: eager code and ``tf.function`` (automatic control
  dependencies order the writes);
* :class:`TF1Backend`: graphs built by hand (TF1 code), whose assignments
  return the ops the algorithm orders explicitly;
* :class:`TF2Backend` / :class:`TF2GraphBackend`: the three
  ``tf.function`` families (:mod:`accum_optimizer.families._tf_route`),
  whose scattered variables leave copy-on-read mode, in a ``tf.function``
  or a ``tf.compat.v1`` graph.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer import _args
from accum_optimizer._compat import tf as tf_compat
from accum_optimizer.families._accumulating import (
    shape_mismatch,
    weight_shape_error,
    weight_type_error,
    weight_value_error,
)

tf1 = tf.compat.v1


class TFBackend:
    """:class:`~accum_optimizer.core.state.Backend` over ``tf.Variable`` s in
    TF2 code (eager or ``tf.function``, ordered by automatic control
    dependencies), replica-local (``ON_READ``) variables included.

    Args:
        apply_inner: ``apply_inner(window_grads, gates)``, the family's one
            call of its inner optimizer (see the protocol).
        writer: the optimizer whose ``assign(variable, value)`` and
            ``assign_add(variable, value)`` make the dense writes (the Keras
            3 wrapper: Keras' optimizers write through their own ``assign*``,
            which Keras' tests patch), or ``None``: on the ``tf.Variable``.
    """

    def __init__(self, apply_inner: Callable[[list, dict], Any] | None = None, writer: Any = None) -> None:
        self._apply_inner = apply_inner
        self._writer = writer

    # -- the family's variables and inner optimizer
    # (On the tf.Variable itself, as Keras 3's own `optimizer.assign` does: a
    # Keras variable's `assign_add` is a read, an add and an assign.)
    def assign(self, variable: Any, value: Any) -> Any:
        if self._writer is not None:
            self._writer.assign(variable, tf.cast(value, self.dtype(tf_variable(variable))))
            return
        variable = tf_variable(variable)
        variable.assign(tf.cast(value, self.dtype(variable)), read_value=False)

    def assign_add(self, variable: Any, value: Any) -> Any:
        if self._writer is not None and not isinstance(value, tf.IndexedSlices):
            self._writer.assign_add(variable, tf.cast(value, self.dtype(tf_variable(variable))))
            return
        variable = tf_variable(variable)
        if isinstance(value, tf.IndexedSlices):
            # Scatter into the resource handle: in replica context a
            # replica-local variable's handle is this replica's own (its
            # container has no scatter ops).
            tf.raw_ops.ResourceScatterAdd(
                resource=variable.handle, indices=value.indices, updates=tf.cast(value.values, self.dtype(variable))
            )
            self.scattered(variable)
        else:
            variable.assign_add(tf.cast(value, self.dtype(variable)), read_value=False)

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> Any:
        variable = tf_variable(variable)
        tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=indices, updates=tf.cast(updates, self.dtype(variable))
        )
        self.scattered(variable)

    def scattered(self, variable: Any) -> None:
        """Called after a scatter into ``variable`` (a hook: see
        :meth:`accum_optimizer.families._tf_backend.TF2Backend.scattered`)."""

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        static = None if isinstance(pred, tf.Variable) else tf.get_static_value(pred)
        if static is not None:  # known when traced: build one branch only
            true_fn() if static else false_fn()
            return None
        tf.cond(pred, lambda: _none(true_fn()), lambda: _none(false_fn()))
        return None

    def apply_inner(self, window_grads: list, gates: dict) -> Any:
        return self._apply_inner(window_grads, gates)

    def after(self, values: Any) -> Any:
        deps = control_inputs(values)
        return tf.control_dependencies(within_graph(deps)) if deps else contextlib.nullcontext()

    # -- values
    read = staticmethod(tf.convert_to_tensor)
    cast = staticmethod(tf.cast)
    constant = staticmethod(tf.constant)
    add = staticmethod(tf.math.add)
    equal = staticmethod(tf.equal)
    greater = staticmethod(tf.greater)
    greater_equal = staticmethod(tf.greater_equal)
    less = staticmethod(tf.less)
    logical_and = staticmethod(tf.logical_and)
    maximum = staticmethod(tf.maximum)
    where = staticmethod(tf.where)
    reduce_max = staticmethod(tf.reduce_max)
    floormod = staticmethod(tf.math.floormod)
    divide = staticmethod(tf.math.truediv)  # what `x / y` is for tensors
    ones_like = staticmethod(tf.ones_like)
    zeros_like = staticmethod(tf.zeros_like)

    def dtype(self, value: Any) -> Any:
        # A Keras variable's own dtype (its `dtype` follows an autocast
        # scope); a TF1 RefVariable's is `float32_ref`.
        return tf.as_dtype(tf_variable(value).dtype).base_dtype

    def fill_like(self, variable: Any, value: Any) -> Any:
        return tf.fill(tf.shape(tf_variable(variable)), tf.cast(value, self.dtype(variable)))

    def fill_rows_like(self, variable: Any, rows: Any, value: Any) -> Any:
        shape = tf.concat([tf.shape(rows)[:1], tf.constant(static_shape(variable)[1:], tf.int32)], 0)
        return tf.fill(shape, tf.cast(value, self.dtype(variable)))

    def unfoldable_zero(self, counter: Any) -> Any:
        # `assign(acc, zeros(shape))` with a constant 0 gets constant-folded
        # by TensorFlow's graph optimizer into a constant as large as the
        # accumulator, which the traced function then keeps alive: one more
        # copy of the parameters, resident for good (measured on a 244 MiB
        # embedding table). `max(min(counter, 0), 0)` is 0 for every integer
        # but is only known when the step runs.
        return tf.maximum(tf.minimum(tf.convert_to_tensor(counter), 0), 0)

    def piecewise(self, x: Any, boundaries: Sequence[int], values: Sequence[int]) -> Any:
        position = tf.reduce_sum(tf.cast(tf.constant(list(boundaries), tf.int64) <= x, tf.int32)) - 1
        return tf.gather(tf.constant(list(values), tf.int64), position)

    def checked_positive(self, value: Any, message: str) -> Any:
        with tf.control_dependencies([tf.debugging.assert_positive(value, message=message)]):
            return tf.identity(value)

    # -- gradients
    def all_finite(self, grads: Sequence[Any]) -> Any:
        # One `is_finite` reduction per gradient, combined into one scalar
        # in the graph: no host sync.
        flags = [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
        if not flags:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(flags)) if len(flags) > 1 else flags[0]

    def scale(self, grad: Any, weight: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * tf.cast(weight, grad.values.dtype), grad.indices, grad.dense_shape)
        return grad * tf.cast(weight, grad.dtype)

    def cast_gradient(self, grad: Any, dtype: Any) -> Any:
        if dtype is None:
            return grad
        dtype = tf.as_dtype(dtype).base_dtype
        if grad.dtype.base_dtype == dtype:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
        return tf.cast(grad, dtype)

    def is_sparse(self, grad: Any) -> bool:
        return isinstance(local_value(grad), tf.IndexedSlices)

    def sparse_indices(self, grad: Any) -> Any:
        return grad.indices

    def touched(self, tracker: Any) -> Any:
        return tf.reshape(tf.where(tf.convert_to_tensor(tracker) > 0), [-1])

    def gather_rows(self, variable: Any, rows: Any) -> Any:
        # On the tf.Variable itself, so that the gather is a ResourceGather of
        # the rows: a gather on the Keras variable reads the whole
        # accumulator first (a table-sized copy).
        return tf.gather(tf_variable(variable), rows)

    def sparse(self, values: Any, rows: Any, like: Any) -> Any:
        return tf.IndexedSlices(values, rows, dense_shape=tf.constant(static_shape(like), tf.int64))


class TF1Backend(TFBackend):
    """The core's backend for TF1: every assignment returns its op (``None``
    eagerly) so that the algorithm can order them with control
    dependencies; ``cond`` is ``tf.cond`` with branches returning grouped
    ops. ``made`` collects the ops made outside any ``cond`` (grouped into
    the train op)."""

    def __init__(self, apply_inner: Any = None) -> None:
        super().__init__(apply_inner)
        self.made: list = []
        self._depth = 0

    def _record(self, op: Any) -> Any:
        if tf.executing_eagerly():
            return None
        op = op.op if not isinstance(op, tf.Operation) else op
        if self._depth == 0:
            self.made.append(op)
        return op

    def assign(self, variable: Any, value: Any) -> Any:
        return self._record(variable.assign(value, read_value=False))

    def assign_add(self, variable: Any, value: Any) -> Any:
        if isinstance(value, tf.IndexedSlices):
            return self._record(tf1.scatter_add(variable, value.indices, value.values))
        return self._record(variable.assign_add(value, read_value=False))

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> Any:
        return self._record(tf1.scatter_update(variable, indices, updates))

    def cond(self, pred: Any, true_fn: Any, false_fn: Any) -> Any:
        def branch(fn):
            def run():
                self._depth += 1
                try:
                    return tf.group(*control_inputs(fn()))
                finally:
                    self._depth -= 1

            return run

        return tf.cond(pred, branch(true_fn), branch(false_fn))


class TF2Backend(TFBackend):
    """The TF2 families' backend: scattered variables leave copy-on-read mode.

    Args:
        fence_variables: ``fence_variables()``, every variable the inner
            update may write (the inner optimizer's and the model's), or
            ``None``: :meth:`fence` then declines.
    """

    def __init__(self, apply_inner: Callable[[list, dict], Any] | None = None, writer: Any = None,
                 fence_variables: Callable[[], Sequence[Any]] | None = None) -> None:
        super().__init__(apply_inner, writer)
        self._fence_variables = fence_variables

    def fence(self, after: Any) -> bool:
        """Make every later write of the variables the inner update may
        write wait for ``after``, and none of its reads or arithmetic: one
        read of each after ``after``, which TensorFlow's automatic control
        dependencies (a ``tf.function``) order each later write of that
        variable after. ``False`` (nothing done) where there is nothing to
        wait for or no such ordering (no ``fence_variables``; a
        ``tf.compat.v1`` graph, :class:`TF2GraphBackend`)."""
        if self._fence_variables is None or not control_inputs(after) or not tf.inside_function():
            return False
        with self.after(after):
            for variable in self._fence_variables():
                tf_variable(variable).value()
        return True

    def scattered(self, variable: Any) -> None:
        tf_compat.disable_copy_on_read(variable)


class TF2GraphBackend(TF1Backend, TF2Backend):
    """The TF2 families' backend in a ``tf.compat.v1`` graph (legacy
    optimizers in TF1-style code, Keras 2's graph-mode ``fit``), where no op
    runs unless fetched: every write returns its op, ordered explicitly, and
    the micro-step's op groups them (:class:`TF1Backend`)."""


def _none(_: Any) -> None:
    return None


def validate_accumulator_dtype(value: Any) -> str | None:
    """``accumulator_dtype`` as a dtype name (``"float32"``), or ``None``.

    Raises:
        ValueError: not ``None`` or a floating dtype (a name, ``tf.DType`` or
            NumPy dtype; numbers, which ``tf.as_dtype`` reads as enum values,
            are refused).
    """
    if value is None:
        return None
    dtype = None
    if not isinstance(value, (bool, int, float)):
        try:
            dtype = tf.as_dtype(value)
        except (TypeError, ValueError):
            dtype = None
    if dtype is None or not dtype.is_floating:
        raise _args.bad_accumulator_dtype(value)
    return dtype.base_dtype.name


def tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable (its ``value``), else
    ``variable`` itself."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def _values(grad: Any) -> Any:
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def static_shape(variable: Any) -> list[int]:
    """A variable's shape as ints (variables have a static shape)."""
    return [int(d) for d in variable.shape]


def local_value(value: Any) -> Any:
    """One replica's value of a per-replica value (the value itself otherwise)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def control_inputs(values: Any) -> list:
    """The tensors and ops behind ``values`` (nested; sparse and per-replica
    values expanded), to order what follows after them; empty when
    executing eagerly, where there is nothing to order."""
    if tf.executing_eagerly():
        return []
    found = []
    for v in tf.nest.flatten(values, expand_composites=True):
        if isinstance(v, (tf.Tensor, tf.Operation)):
            found.append(v)
        elif isinstance(getattr(v, "op", None), tf.Operation):
            found.append(v.op)
    return found


def within_graph(deps: list) -> list:
    """``deps`` as control inputs that hold in the graph being built.

    In a function's graph (a ``cond`` branch of a ``tf.function``),
    TensorFlow keeps no control dependency on a tensor of an enclosing
    graph (``tf.control_dependencies`` records it as a control capture,
    which ``tf.cond`` drops; checked with TensorFlow 2.15, 2.16 and 2.21):
    the writes of a micro-step's branches would not wait for the gradient
    they must wait for (``accum_optimizer.core.micro_step``: a step whose
    input ends writes nothing). Those tensors are taken in as data instead,
    by one ``IdentityN`` in the graph being built, whose op is the
    dependency."""
    graph = tf.compat.v1.get_default_graph()
    if not graph.building_function:
        return deps
    inner, outer = [], []
    for d in deps:
        home = _graph_of(d) if isinstance(d, tf.Tensor) else graph
        if home is graph:
            inner.append(d)
        elif home is not None:  # (an eager tensor has none: nothing to wait for)
            outer.append(d)
    return inner + ([tf.identity_n(outer)[0].op] if outer else [])


def _graph_of(tensor: Any) -> Any:
    try:
        return tensor.graph
    except AttributeError:  # an eager tensor has none
        return None


# ------------------------------------------------------------------ checks
def check_weight(weight: Any) -> Any:
    """Check a micro-step's ``weight`` (its count ``c``); return it as a
    float32 scalar tensor, or ``None`` for ``None``.

    Python numbers and eager tensors are checked at once; a symbolic tensor
    (inside ``tf.function``) when the step runs: the micro-step's writes wait
    for an assertion, so a negative or non-finite weight stops the step with
    ``InvalidArgumentError`` before any state changes.

    Raises:
        TypeError: not a real number or numeric tensor.
        ValueError: not a scalar; negative, NaN or infinite.
    """
    if weight is None:
        return None
    try:
        if isinstance(weight, (bool, str, bytes)):
            raise TypeError
        value = tf.convert_to_tensor(weight)
        if not (value.dtype.is_floating or value.dtype.is_integer) or value.dtype == tf.bool:
            raise TypeError
    except (TypeError, ValueError):
        raise weight_type_error(weight) from None
    value = tf.cast(value, tf.float32)
    if value.shape.rank is not None and value.shape.rank != 0:
        raise weight_shape_error(tuple(value.shape))
    if tf.executing_eagerly() or tf.get_static_value(value) is not None:
        number = float(tf.get_static_value(value))
        if not (number >= 0 and number < float("inf")):
            raise weight_value_error(number)
        return value
    check = tf.debugging.assert_all_finite(value, "`weight` must be finite")
    with tf.control_dependencies([check, tf.debugging.assert_non_negative(value, message="`weight` must be >= 0")]):
        return tf.identity(value)


def check_gradient_shapes(grads: Sequence[Any], variables: Sequence[Any], name_of: Callable[[Any], str]) -> None:
    """Raise ValueError if a gradient's static shape differs from its variable's.

    ``grads[i]`` is a tensor, a ``tf.IndexedSlices`` (its static
    ``dense_shape`` is checked) or ``None`` (skipped); dimensions unknown at
    trace time are skipped here (:func:`shape_checked` checks them when the
    step runs). ``name_of(variable)`` names the variable in the message.
    """
    for g, v in zip(grads, variables):
        if g is None:
            continue
        g_shape, v_shape = _gradient_shape(g), tuple(v.shape)
        if g_shape is None:
            continue
        if len(g_shape) != len(v_shape) or any(
            a is not None and b is not None and a != b for a, b in zip(g_shape, v_shape)
        ):
            raise shape_mismatch(g_shape, v_shape, name_of(v))


def shape_checked(grads: Sequence[Any], variables: Sequence[Any], name_of: Callable[[Any], str]) -> list:
    """``grads`` with each dense gradient whose shape is not fully known at
    trace time checked when the step runs (``tf.ensure_shape``). Where any
    is, every gradient waits for every check: each accumulator's write waits
    only for its own gradient, and a failed check must stop them all (the
    micro-step is all or nothing)."""
    checks = [
        tf.ensure_shape(g, v.shape, name=f"gradient_shape_of_{op_name(name_of(v))}")
        for g, v in zip(grads, variables)
        if not (g is None or isinstance(g, tf.IndexedSlices) or g.shape.is_fully_defined())
    ]
    if not checks:
        return list(grads)
    with tf.control_dependencies(checks):
        return [
            None if g is None
            else tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
            else tf.identity(g)
            for g in grads
        ]


def _gradient_shape(value: Any) -> tuple | None:
    """Static shape of a gradient (``dense_shape`` of a ``tf.IndexedSlices``),
    ``None`` where unknown."""
    if isinstance(value, tf.IndexedSlices):
        if value.dense_shape is None:
            return None
        static = tf.get_static_value(value.dense_shape)
        return None if static is None else tuple(int(d) for d in static)
    shape = getattr(value, "shape", None)
    if shape is None or shape.rank is None:
        return None
    return tuple(None if d is None else int(d) for d in shape)


def as_gradients(grads: Sequence[Any], variables: Sequence[Any]) -> list:
    """Gradients as the inner optimizer takes them: tensors and ``None`` as
    they are; a ``tf.IndexedSlices`` with its parts as tensors (NumPy values
    and indices, which ``OptimizerV2`` accepts, converted: values in the
    variable's dtype, indices and ``dense_shape`` as integer tensors);
    anything else (NumPy arrays, Python lists) converted to a tensor of its
    variable's dtype."""
    return [_as_gradient(g, v) for g, v in zip(grads, variables)]


def _as_gradient(g: Any, v: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        if tf.is_tensor(g.values) and tf.is_tensor(g.indices):
            return g
        shape = g.dense_shape
        return tf.IndexedSlices(
            _as_tensor(g.values, v.dtype), tf.convert_to_tensor(g.indices),
            None if shape is None else tf.convert_to_tensor(shape),
        )
    if g is None or isinstance(g, tf.Variable) or tf.is_tensor(g) or hasattr(g, "dense_shape"):
        return g
    return tf.convert_to_tensor(g, dtype=v.dtype)


def _as_tensor(value: Any, dtype: Any) -> Any:
    return value if tf.is_tensor(value) else tf.convert_to_tensor(value, dtype=tf.as_dtype(dtype).base_dtype)


def op_name(name: str) -> str:
    """``name`` with the characters TF op names refuse replaced."""
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in name)


def check_strategy() -> None:
    """Refuse the ``tf.distribute`` strategies that cannot accumulate.

    Accumulation needs synchronous replicas that each own a replica-local
    (``ON_READ``) accumulator. Strategies of the parameter-server family
    hold every variable once, on parameter servers or the CPU, and let all
    replicas update it: the accumulator is shared, each replica adds its
    part, and the inner optimizer's all-reduce then counts every gradient
    once per replica (measured under ``CentralStorageStrategy`` with 2
    replicas: exactly the update of twice the learning rate, no error).
    ``ParameterServerStrategy`` workers also step asynchronously, so N
    micro-steps of one worker are no window of the global batch.

    Raises:
        ValueError: the strategy in scope is one of those.
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    for name, why in _REFUSED_STRATEGIES.items():
        classes = (getattr(tf.distribute.experimental, name), getattr(tf.compat.v1.distribute.experimental, name))
        if isinstance(strategy, classes):
            raise ValueError(
                f"AccumulatingOptimizer does not support {name} (the "
                f"tf.distribute strategy in scope is {type(strategy).__name__}): "
                f"{why}. Use tf.distribute.MirroredStrategy on one host or "
                "tf.distribute.MultiWorkerMirroredStrategy across hosts: "
                "synchronous replicas, replica-local accumulators, one "
                "all-reduce per update."
            )


_REFUSED_STRATEGIES = {
    "ParameterServerStrategy": (
        "its workers step asynchronously, each at its own pace, so N "
        "micro-steps of one worker are not a window of the global batch; and "
        "the accumulators would live once on the parameter servers, shared "
        "by every worker"
    ),
    "CentralStorageStrategy": (
        "it keeps one copy of every variable, shared by all replicas, so the "
        "accumulators cannot be replica-local: every replica would add into "
        "the same slot and the inner optimizer's all-reduce would count each "
        "gradient once per replica (a silently wrong update)"
    ),
}
