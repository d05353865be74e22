"""`AccumulatingOptimizer` for the Keras 2 new optimizer API.

The Keras 2 *new* optimizer API is ``tf.keras.optimizers.Optimizer`` on
TF 2.11-2.15 (``keras.src.optimizers.optimizer.Optimizer`` of Keras 2.15) and
``tf_keras.optimizers.Optimizer`` (TF >= 2.16, with ``TF_USE_LEGACY_KERAS=1``
or imported directly). It is Keras 3's ancestor: ``build``,
``apply_gradients``, ``update_step``, ``_apply_weight_decay``, EMA,
``iterations``, and a distributed apply that runs in one ``merge_call``
(``Optimizer._distributed_apply_gradients_fn``). The legacy ``OptimizerV2``
classes (``tf.keras.optimizers.legacy``) are another family.

The wrapper subclasses the ``Optimizer`` of the inner optimizer's own package
(so that this package's ``Model.compile``, ``LossScaleOptimizer`` and saving
accept it): :func:`wrapper_class` builds one class per package, registered
with that package's ``register_keras_serializable(package="accum_optimizer")``
as ``"AccumulatingOptimizer"``. The module-level :data:`AccumulatingOptimizer`
is the class of the active ``tf.keras`` when that is Keras 2, else of the
imported ``tf_keras``. This module imports no Keras package itself: it uses
the ones already imported.

The algorithm is :func:`accum_optimizer._accumulation.micro_step`; this module
supplies its :class:`Backend` (``tf.Variable`` ops, ``tf.cond``) and the
function that calls the inner optimizer once per update.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import sys
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from accum_optimizer import _accumulation as acc_lib
from accum_optimizer import _dispatch
from accum_optimizer.families._keras2_common import deserialize_schedule, serialize_schedule, weighted_windows

# Arguments of the Keras 2 `Optimizer.__init__` that belong on the inner
# optimizer, with their defaults (accepted when equal to the default, or None,
# so that configs written by generic code still load). `weight_decay`
# defaults to 0 in `Optimizer` and to None in its subclasses.
_INNER_ONLY_ARGS = {
    "learning_rate": None,
    "weight_decay": 0,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "jit_compile": True,
    "mesh": None,
    "is_legacy_optimizer": False,
}

_ON_READ = tf.VariableSynchronization.ON_READ


# ----------------------------------------------------------------- packages
def _keras2_package_of(optimizer: Any) -> Any:
    """The imported Keras 2 package whose new-API ``Optimizer`` ``optimizer``
    is an instance of, or None."""
    for package in _dispatch._keras2_packages():
        if isinstance(optimizer, package.optimizers.Optimizer):
            return package
    return None


def _default_package() -> Any:
    """The active ``tf.keras`` if it is Keras 2, else an imported ``tf_keras``.

    Raises:
        ImportError: no Keras 2 package is imported (nothing to subclass).
    """
    kind, package = _dispatch.active_keras()
    if kind == "keras2":
        return package
    imported = _dispatch._keras2_packages()
    if imported:
        return imported[0]
    raise ImportError(
        "accum_optimizer.families.keras2 needs a Keras 2 package: tf.keras must "
        "be Keras 2 (TensorFlow <= 2.15, or TF_USE_LEGACY_KERAS=1 with tf_keras "
        "installed), or tf_keras must be imported."
    )


@functools.lru_cache(maxsize=None)
def wrapper_class(package: Any) -> type:
    """The ``AccumulatingOptimizer`` class for one Keras 2 package.

    Args:
        package: the imported ``tf_keras`` module, or ``keras`` 2.x.

    Returns:
        A subclass of ``package.optimizers.Optimizer``, registered with
        ``package.saving.register_keras_serializable(package="accum_optimizer")``
        (registered name ``"accum_optimizer>AccumulatingOptimizer"``). One class
        per package (cached).
    """
    base = package.optimizers.Optimizer
    base_module = sys.modules[base.__module__]

    class AccumulatingOptimizer(_Keras2Accumulating, base):
        __doc__ = _Keras2Accumulating.__doc__
        _keras = package
        _plain_weight_decay = staticmethod(base_module._BaseOptimizer._apply_weight_decay)
        _callable_list = base_module.CallableList

    AccumulatingOptimizer.__module__ = __name__
    AccumulatingOptimizer.__qualname__ = "AccumulatingOptimizer"
    register = package.saving.register_keras_serializable(
        package="accum_optimizer", name="AccumulatingOptimizer"
    )
    return register(AccumulatingOptimizer)


# -------------------------------------------------------------- the wrapper
class _Keras2Accumulating:
    """Accumulate gradients over micro-batches, update once per window (Keras 2).

    Each call to :meth:`apply_gradients` (or ``minimize``, which ``fit``
    uses) is one *micro-step*: the gradients are added into accumulator
    slots (one non-trainable variable per trainable variable, same shape and
    dtype). On every ``gradient_accumulation_steps``-th micro-step the inner
    optimizer's ``apply_gradients`` is called once with the window's gradient
    (the mean, or the sum, of the accumulated micro-batch gradients) and the
    slots are zeroed. Between updates the model weights and all of the inner
    optimizer's state (slots, ``iterations``, EMA, the current learning rate
    of a schedule) are left bitwise untouched, so ``N`` micro-batches of
    ``B`` samples train exactly like one batch of ``N * B`` samples when the
    loss is a mean over the batch.

    Args:
        inner_optimizer: a Keras 2 new-API optimizer (``tf.keras.optimizers.Adam()``
            where ``tf.keras`` is Keras 2, or ``tf_keras.optimizers.Adam()``),
            or an identifier that this package's ``optimizers.get`` resolves
            (``"adam"``). Clipping, weight decay, EMA and learning-rate
            schedules are set on it; they act once per update, on the
            window's gradient, and schedules see update counts.
        gradient_accumulation_steps: ``int >= 1``, the number ``N`` of
            micro-steps per update. ``1`` is a pass-through to the inner
            optimizer (no accumulator slots are created). Or a schedule over
            updates: a dict ``{first_update: N, ...}`` (piecewise constant,
            int keys strictly ascending from 0; kept in ``get_config``) or a
            callable ``update_index -> N`` (an int64 scalar tensor in, an int
            or int scalar tensor out; ``get_config`` needs it registered with
            the package's ``register_keras_serializable``): a window that
            starts at update ``u`` has ``N(u)`` micro-steps
            (:func:`accum_optimizer._accumulation.validate_accumulation_schedule`).
        reduction: ``"mean"`` (default) applies ``sum / N``, equivalent to the
            large batch for a mean-reduced loss; ``"sum"`` applies the sum.
        name: optional name of the wrapper (default ``"AccumulatingOptimizer"``).

    State (``tf.Variable``s, saved wherever Keras 2 saves optimizer state):
        ``micro_steps``: int64 scalar, micro-steps taken (units: micro-steps).
        ``iterations``: the inner optimizer's int64 counter, i.e. updates
            taken (units: updates). After ``m`` micro-steps,
            ``iterations == m // N`` and ``micro_steps == m``.
        ``acc_grads``: accumulator slots, shape and dtype of each trainable
            variable (``true_dtype`` under mixed precision). Under
            ``tf.distribute`` they are ``ON_READ`` variables (each replica
            keeps its local sum; reading them in cross-replica context, as
            saving does, gives the sum over replicas).
        ``grad_received``: int64 vector ``(num_trainable_variables,)``, 1
            where a variable has had a gradient in the current window.
        ``mini_step``: int64 scalar, micro-steps in the current window (its
            position; units: micro-steps); -1 until the first micro-step or
            :meth:`flush` ("unknown": then ``micro_steps % N``, what it was in
            state saved before it existed). After :meth:`flush` or under a
            schedule it differs from ``micro_steps % N``.
        ``window_weight``: float32 scalar, the window's ``Σ cᵢ`` (each
            micro-step's ``weight``, 1 without one); ``ON_READ`` summed
            under ``tf.distribute``.
        (``mini_step`` and ``window_weight`` come last in :attr:`variables`,
        after the inner optimizer's: state saved without them restores.)

    Weighted micro-batches (``apply_gradients(..., weight=c)``), the partial
    window (:meth:`flush`) and schedules follow the Keras 3 family
    (``accum_optimizer.families.keras3``); the window's gradient is
    ``Σ cᵢ·gᵢ / Σ cᵢ`` under ``"mean"``.

    ``learning_rate`` and ``lr`` (read and assigned by Keras 2's
    ``LearningRateScheduler`` and ``ReduceLROnPlateau``) forward to the inner
    optimizer.

    Missing gradients: a ``None`` gradient contributes nothing on that
    micro-step; a variable with no gradient in the whole window is not
    updated (neither its weight, its slots, its weight decay, its EMA shadow
    nor its constraint), as Keras 2 leaves a variable whose gradient is
    ``None`` in the large batch. Sparse ``tf.IndexedSlices`` gradients are
    scatter-added into the slots, never densified per micro-step; the update
    hands the dense window gradient to the inner optimizer (every Keras 2
    new-API optimizer gives an untouched row the same update, to rounding,
    for a zero row of a dense gradient as for a row absent from an
    ``IndexedSlices`` one, so the result matches the sparse large batch).

    ``nonfinite`` and ``accumulator_dtype`` (the Keras 3 family's non-finite
    policies and wider accumulators) accept only their defaults here,
    ``"propagate"`` and ``None``.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras 2 new-API optimizer, or
            ``gradient_accumulation_steps`` is not an int, dict or callable
            (or a schedule key or value is not an int), or a required
            argument is missing, or an unknown keyword argument is given.
        ValueError: ``gradient_accumulation_steps < 1`` (or a schedule's N,
            or its keys not strictly ascending from 0); ``reduction`` not in
            ``("mean", "sum")``; ``nonfinite`` other than ``"propagate"`` or
            an ``accumulator_dtype``; ``inner_optimizer`` is a
            ``LossScaleOptimizer`` or already an ``AccumulatingOptimizer``;
            base-optimizer arguments (``clipnorm``, ``weight_decay``, ...) are
            passed to the wrapper instead of the inner optimizer.
    """

    _keras: Any  # the Keras 2 package; set by `wrapper_class`
    _plain_weight_decay: Any
    _callable_list: Any

    def __new__(cls, inner_optimizer: Any = acc_lib.REQUIRED, *args: Any, **kwargs: Any) -> Any:
        # An inner optimizer of another imported Keras 2 package (tf_keras and
        # Keras 2.15 in one process) gets that package's wrapper class.
        package = _keras2_package_of(inner_optimizer)
        if package is not None and package is not cls._keras:
            return wrapper_class(package)(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        inner_optimizer: Any = acc_lib.REQUIRED,
        gradient_accumulation_steps: int = acc_lib.REQUIRED,
        reduction: str = "mean",
        name: str | None = None,
        nonfinite: str = "propagate",
        accumulator_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        for arg, default in _INNER_ONLY_ARGS.items():
            if arg not in kwargs:
                continue
            value = kwargs.pop(arg)
            if value is not None and value != default:
                raise ValueError(
                    f"AccumulatingOptimizer does not take `{arg}` (received "
                    f"{arg}={value!r}). Set it on the inner optimizer, e.g. "
                    f"{self._keras.__name__}.optimizers.Adam({arg}=...), where it "
                    "acts once per update on the window's gradient."
                )
        acc_lib.check_arguments(
            inner_optimizer, gradient_accumulation_steps, kwargs,
            accepted=acc_lib.ARGUMENTS + acc_lib.NUMERICS_ARGUMENTS,
        )
        steps = acc_lib.validate_accumulation_schedule(gradient_accumulation_steps)
        reduction = acc_lib.validate_reduction(reduction)
        # The non-finite policies and wider accumulators of the Keras 3 family
        # are not implemented here yet: their defaults only.
        acc_lib.validate_nonfinite(nonfinite, supported=("propagate",))
        if accumulator_dtype is not None:
            raise ValueError(
                "`accumulator_dtype` is not supported by the Keras 2 family yet "
                f"(received accumulator_dtype={accumulator_dtype!r}); the "
                "accumulators take each variable's dtype. Accepted: None."
            )
        inner = self._resolve_inner(inner_optimizer)
        super().__init__(name=name or "AccumulatingOptimizer", jit_compile=False)
        self.inner_optimizer = inner
        # (Not tracked: a dict schedule must stay a plain dict.)
        self.gradient_accumulation_steps = self._no_dependency(steps)
        self._window_length = self._no_dependency(acc_lib.window_length(steps))
        self._window_variables = self._no_dependency([])
        self._flush_function = self._no_dependency(None)
        self.reduction = reduction
        self._deferred_state = self._no_dependency(None)
        self._skip_aggregation = False
        self._gating = self._no_dependency(_Gating())

    @classmethod
    def _resolve_inner(cls, inner_optimizer: Any) -> Any:
        package = cls._keras
        if isinstance(inner_optimizer, (str, dict)):
            try:
                inner_optimizer = _deserialize(package, inner_optimizer)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    "`inner_optimizer` could not be resolved by "
                    f"{package.__name__}.optimizers.get. Received: inner_optimizer="
                    f"{inner_optimizer!r}. ({e})"
                ) from None
        if isinstance(inner_optimizer, _Keras2Accumulating):
            raise ValueError(
                "`inner_optimizer` is already an AccumulatingOptimizer "
                f"(gradient_accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}); nesting them "
                "would accumulate twice. Use one AccumulatingOptimizer with "
                "gradient_accumulation_steps equal to the product."
            )
        if not isinstance(inner_optimizer, package.optimizers.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a Keras 2 optimizer instance "
                f"(`{package.__name__}.optimizers.Optimizer`, e.g. "
                f"{package.__name__}.optimizers.Adam()) or an identifier that "
                f"`{package.__name__}.optimizers.get` resolves (e.g. 'adam'). "
                f"Received: inner_optimizer={inner_optimizer!r} of type "
                f"{type(inner_optimizer).__module__}.{type(inner_optimizer).__qualname__}."
            )
        if isinstance(inner_optimizer, package.mixed_precision.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` must not be a LossScaleOptimizer (received "
                f"inner_optimizer={inner_optimizer!r}). Put the loss scaling "
                "outside: LossScaleOptimizer(AccumulatingOptimizer(inner, N)). "
                "Under the 'mixed_float16' policy, model.compile does that by "
                "itself; with a LossScaleOptimizer inside, it would wrap a second "
                "one around the first and unscale the gradients twice."
            )
        return inner_optimizer

    # ------------------------------------------------------------------ state
    def _create_iteration_variable(self) -> None:
        # No counter of our own: `iterations` is the inner optimizer's.
        pass

    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulator slots, the counters and the inner's variables.

        Runs in ``tf.init_scope`` (eagerly, outside any traced function), as
        Keras 2's ``apply_gradients`` builds. Idempotent.
        """
        if getattr(self, "_built", False):
            return
        var_list = list(var_list)
        self._build_index_dict(var_list)
        self._trainable_variables = self._no_dependency(var_list[:])
        with tf.init_scope():
            with tf.name_scope(self.name):
                self.micro_steps = self._add_counter(tf.constant(0, tf.int64), "micro_steps")
                self.mini_step = self.window_weight = None
                if self._accumulates:
                    self.grad_received = self._add_counter(tf.zeros([len(var_list)], tf.int64), "grad_received")
                    self.acc_grads = [self._add_accumulator(v) for v in var_list]
                    # The window's position and count, after the inner
                    # optimizer's variables in `variables` (state saved
                    # without them, by 0.2.0.dev0 and older, is a prefix).
                    # `mini_step` starts at -1, "unknown": the first
                    # micro-step or flush sets it to `micro_steps % N`, what
                    # it was before it was kept (see `_resume_position`), so
                    # that a checkpoint saved without it resumes exactly.
                    self.mini_step = self._add_counter(
                        tf.constant(acc_lib.UNKNOWN_POSITION, tf.int64), "mini_step", keep=False
                    )
                    self.window_weight = tf.Variable(
                        tf.constant(0.0, tf.float32), trainable=False, name="window_weight",
                        synchronization=_ON_READ, aggregation=tf.VariableAggregation.SUM,
                    )
                    self._window_variables[:] = [self.mini_step, self.window_weight]
                else:
                    self.grad_received = None
                    self.acc_grads = []
            # Named as the plain inner optimizer names its variables.
            with tf.name_scope(self.inner_optimizer.name):
                self.inner_optimizer.build(var_list)
        self._built = True
        if self._deferred_state is not None:
            state, self._deferred_state = self._deferred_state, self._no_dependency(None)
            with tf.init_scope():
                self.load_own_variables(state)

    def _add_counter(self, initial_value: Any, name: str, keep: bool = True) -> tf.Variable:
        variable = tf.Variable(
            initial_value,
            trainable=False,
            name=name,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        if keep:
            self._variables.append(variable)
        return variable

    @property
    def _accumulates(self) -> bool:
        """Whether micro-steps go through windows (else: the pass-through)."""
        steps = self.gradient_accumulation_steps
        return not isinstance(steps, int) or steps > 1

    def _add_accumulator(self, reference: Any) -> tf.Variable:
        """One slot per trainable variable: a replica-local (``ON_READ``,
        summed on read) zero-initialised copy of its shape and dtype."""
        dtype = getattr(reference, "true_dtype", reference.dtype)
        with self._distribution_strategy.extended.colocate_vars_with(reference):
            variable = tf.Variable(
                tf.zeros(reference.shape, dtype),
                trainable=False,
                name=f"acc_grad/{_shared_name(reference)}",
                synchronization=_ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
        self._variables.append(variable)
        return variable

    @property
    def variables(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        ``acc_grads``), all of the inner optimizer's, then ``mini_step`` and
        ``window_weight`` (a ``CallableList``, as Keras 2 returns)."""
        return self._callable_list(
            list(self._variables) + list(self.inner_optimizer.variables) + list(self._window_variables)
        )

    def __dir__(self):
        # The `.keras` format walks `dir()` for child objects to save. The
        # inner optimizer's variables are already in this optimizer's
        # `variables` (saved and restored together), so hide it there:
        # otherwise its state is written twice.
        return [a for a in super().__dir__() if a != "inner_optimizer"]

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # Keras 2's SavedModel loader revives every saved optimizer as a
        # `RestoredOptimizer`, whose `_iterations` variable must be bound to a
        # saved one, or `load_model` fails. So this node lists the inner
        # optimizer's `iterations` under `_iterations` too: one variable, one
        # saved value, reached by two names.
        children = super()._trackable_children(save_type, **kwargs)
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or "_iterations" in children:
            return children
        return {**children, "_iterations": inner.iterations}

    def _lookup_dependency(self, name, cached_dependencies=None):
        if name == "_iterations" and "inner_optimizer" in self.__dict__:
            return self.inner_optimizer.iterations
        return super()._lookup_dependency(name, cached_dependencies)

    @property
    def iterations(self) -> Any:
        """Updates taken: the inner optimizer's int64 ``iterations``."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable: Any) -> None:
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (getter and setter)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def lr(self) -> Any:
        """Alias of :attr:`learning_rate`: what Keras 2 callbacks
        (``LearningRateScheduler``, ``ReduceLROnPlateau``) read and assign."""
        return self.inner_optimizer.learning_rate

    @lr.setter
    def lr(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Forwarded to the inner optimizer, which owns the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Forwarded: the inner optimizer's EMA overwrite at the end of ``fit``."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`variables`).

        Weights saved before ``mini_step`` and ``window_weight`` existed
        (0.2.0.dev0 and older: all but those two) are accepted; the window's
        position is then ``micro_steps % N`` again.

        Raises:
            ValueError: the optimizer is not built, or the number or shapes of
                ``weights`` do not match :attr:`variables`.
        """
        if not getattr(self, "_built", False):
            raise ValueError(
                "set_weights() needs a built optimizer; call "
                "`optimizer.build(trainable_variables)` first."
            )
        weights = list(weights)
        variables = self._saved_layout(len(weights))
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must have one array per optimizer variable: expected "
                f"{len(variables)}, received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            weight = np.asarray(weight)
            if tuple(variable.shape) != tuple(weight.shape):
                raise ValueError(
                    f"Optimizer variable {variable.name!r} has shape "
                    f"{tuple(variable.shape)}; received a weight of shape "
                    f"{tuple(weight.shape)}."
                )
        for variable, weight in zip(variables, weights):
            variable.assign(np.asarray(weight))
        self._forget_position(variables)

    def _saved_layout(self, saved: int) -> list:
        """The variables that ``saved`` saved arrays fill: :attr:`variables`,
        or, for state saved without the window's ``mini_step`` and
        ``window_weight`` (0.2.0.dev0 and older), all but those two."""
        variables = list(self.variables)
        window = len(self._window_variables)
        if window and saved == len(variables) - window:
            return variables[:saved]
        return variables

    def _forget_position(self, restored: Sequence[Any]) -> None:
        """After restoring state without ``mini_step``: mark it unknown (-1),
        so that the next micro-step derives it from ``micro_steps``."""
        if self.mini_step is not None and not any(v is self.mini_step for v in restored):
            self.mini_step.assign(acc_lib.UNKNOWN_POSITION)
            self.window_weight.assign(0.0)

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """Restore state saved by ``save_own_variables`` (the ``.keras`` and
        ``.weights.h5`` formats).

        On an optimizer that is not built yet the values are kept and
        restored by :meth:`build` (Keras 2 itself would skip them with a
        warning). An empty store (weights saved without optimizer state)
        restores nothing.

        Raises:
            ValueError: if the number of saved variables does not match.
        """
        if len(store.keys()) == 0:
            return
        if not getattr(self, "_built", False):
            self._deferred_state = self._no_dependency({k: np.asarray(store[k]) for k in store.keys()})
            return
        variables = self._saved_layout(len(store.keys()))
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Cannot restore optimizer '{self.name}': it has "
                f"{len(variables)} variables but the saved state has "
                f"{len(store.keys())}. Was it saved with a different inner "
                "optimizer, gradient_accumulation_steps or model?"
            )
        for i, variable in enumerate(variables):
            variable.assign(np.asarray(store[str(i)]))
        self._forget_position(variables)

    # ------------------------------------------------------------ micro-step
    # Not converted by AutoGraph: the micro-step branches with explicit
    # `tf.cond`s only, and converting the adapter and `_accumulation` on every
    # trace doubled the time to trace a train step (0.55 s against 1.13 s for
    # Adam, measured on this 2-core machine).
    @tf.autograph.experimental.do_not_convert
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        name: str | None = None,
        skip_gradients_aggregation: bool = False,
        weight: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Take one micro-step with ``grads_and_vars``.

        ``grads_and_vars`` holds ``(gradient, variable)`` pairs: the gradient
        of the micro-batch loss (a dense tensor of the variable's shape, a
        ``tf.IndexedSlices`` or ``None``). ``skip_gradients_aggregation`` (or
        ``experimental_aggregate_gradients=False``) is handed to the inner
        optimizer's update: pass it when the gradients are already
        all-reduced across replicas.

        ``weight``: the micro-batch's count ``c``, what its mean loss was
        taken over (samples, sum of sample weights, unmasked tokens): a
        Python number or a scalar tensor >= 0, finite; it may differ per
        micro-step (checked by :func:`accum_optimizer._accumulation.check_weight`).
        The window applies ``Σ cᵢ·gᵢ / Σ cᵢ`` (``"mean"``) or ``Σ cᵢ·gᵢ``
        (``"sum"``); a window whose counts sum to 0 applies nothing (the
        inner optimizer is not called, ``iterations`` does not move).
        ``None`` (default): 1, the unweighted window. Under ``tf.distribute``
        each replica passes its own count, and its gradient is its mean
        loss's divided by the replica count, as ``fit`` forms it. The Keras 3
        family's semantics (``accum_optimizer.families.keras3``).

        Returns:
            ``iterations`` (updates taken).

        Raises:
            ValueError: a gradient's shape differs from its variable's; every
                gradient is ``None``; a variable is unknown to the optimizer;
                called in cross-replica context; ``weight`` is not a scalar,
                is negative or not finite (inside ``tf.function``:
                ``InvalidArgumentError`` when the step runs, before any state
                changes).
            TypeError: an unexpected keyword argument; ``weight`` is not a
                number.
        """
        aggregate = kwargs.pop("experimental_aggregate_gradients", True)
        if kwargs:
            raise TypeError(
                "apply_gradients() got unexpected keyword argument(s): "
                f"{', '.join(sorted(kwargs))}. Accepted: grads_and_vars, name, "
                "skip_gradients_aggregation, experimental_aggregate_gradients."
            )
        weight = acc_lib.check_weight(weight)
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, trainable_variables = zip(*grads_and_vars)
        self._apply(list(grads), list(trainable_variables), skip_gradients_aggregation or not aggregate, name, weight)
        return self.iterations

    def _apply(
        self, grads: list, trainable_variables: list, skip_aggregation: bool, name: str | None, weight: Any = None
    ) -> None:
        grads = [
            g if g is None or _is_tensor_like(g) else tf.convert_to_tensor(g, dtype=v.dtype)
            for g, v in zip(grads, trainable_variables)
        ]
        acc_lib.validate_gradient_shapes(grads, trainable_variables, lambda v: v.name)
        if all(g is None for g in grads):
            names = [v.name for v in trainable_variables]
            raise ValueError(f"No gradients provided for any variable: {names}.")
        if not getattr(self, "_built", False):
            with tf.init_scope():
                self.build(trainable_variables)
        self._check_variables_are_known(trainable_variables)
        with tf.name_scope(name or self.name):
            self._micro_step_call(grads, trainable_variables, skip_aggregation, weight)

    def _micro_step_call(
        self, grads: list, trainable_variables: list, skip_aggregation: bool, weight: Any = None
    ) -> None:
        if not self._accumulates:
            # Pass-through; its writes, too, wait for the gradients (see
            # `_accumulation`: a phantom call at the end of an input of
            # unknown length must not count).
            with tf.control_dependencies(acc_lib.gradient_tensors(grads + [weight])):
                if weight is None:
                    self.inner_optimizer.apply_gradients(
                        zip(grads, trainable_variables), skip_gradients_aggregation=skip_aggregation
                    )
                else:
                    # A window of one micro-step: c·g/c = g ("mean") or c·g
                    # ("sum"); a count of 0 applies nothing.
                    if self.reduction == "sum":
                        grads = [None if g is None else acc_lib.scaled(g, weight) for g in grads]
                    tf.cond(
                        weight > 0,
                        lambda: _none(self.inner_optimizer.apply_gradients(
                            zip(grads, trainable_variables), skip_gradients_aggregation=skip_aggregation
                        )),
                        _noop,
                    )
                self.micro_steps.assign_add(1, read_value=False)
            return
        # Put the gradients in build order; variables absent from this call
        # get None (no contribution this micro-step).
        full = [None] * len(self._trainable_variables)
        for g, v in zip(grads, trainable_variables):
            full[self._index_dict[self._var_key(v)]] = g
        self._skip_aggregation = skip_aggregation
        self._tf_apply(full, weight)

    def _check_variables_are_known(self, variables: Sequence[Any]) -> None:
        for v in variables:
            if self._var_key(v) not in self._index_dict:
                raise ValueError(
                    f"Unknown variable: {v.name!r}. This optimizer can only be "
                    "called for the variables it was originally built with. "
                    "When working with a new set of variables, create a new "
                    "optimizer instance (or call `optimizer.build(all_variables)` "
                    "with every variable before the first step)."
                )

    def _tf_apply(self, grads: list, weight: Any = None) -> None:
        """The only place that knows about ``tf.distribute``.

        Under a strategy that needs ``merge_call`` (``MirroredStrategy``), the
        ``cond`` that picks update steps must run in cross-replica context,
        because the inner optimizer's update calls ``merge_call`` (gradient
        all-reduce, weight decay, the distributed apply) and a ``merge_call``
        inside a replica-context ``cond`` fails. So, as Keras 2's
        ``LossScaleOptimizer`` does: one ``merge_call``; each replica adds its
        local gradients into its local (``ON_READ``) slots; the counters move
        once; and on update steps each replica hands its local window
        gradient to the inner optimizer's ``apply_gradients``, whose usual
        all-reduce is the one cross-replica reduction of the window.
        """
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.apply_gradients() must be called in a "
                "replica context (e.g. inside strategy.run), not cross-replica "
                "context."
            )
        # Shapes unknown at trace time are checked when the step runs, before
        # any state changes: the check gates every write of this micro-step.
        checked = [
            g
            if g is None or isinstance(g, tf.IndexedSlices) or g.shape.is_fully_defined()
            else tf.ensure_shape(g, v.shape, name=f"gradient_shape_of_{_op_name(v.name)}")
            for g, v in zip(grads, self._trainable_variables)
        ]
        if not tf.distribute.has_strategy() or tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._micro_step(checked, weight=weight)
            return
        tf.distribute.get_replica_context().merge_call(
            self._cross_replica_step, args=(checked,), kwargs={"weight": weight}
        )

    def _cross_replica_step(self, distribution: Any, grads: list, weight: Any = None) -> None:
        # Runs once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        self._micro_step(grads, _each_replica_of(distribution), weight)

    def _window_state(self) -> acc_lib.WindowState:
        return acc_lib.WindowState(
            self.acc_grads,
            self.micro_steps,
            self.grad_received,
            mini_step=self.mini_step,
            window_weight=self.window_weight,
            updates=self.inner_optimizer.iterations,
        )

    def _resume_position(self, each_replica: Any) -> None:
        """:func:`accum_optimizer._accumulation.resume_position`: a
        ``mini_step`` of -1 (fresh, or restored from a checkpoint saved
        without it) becomes ``micro_steps % N``."""
        acc_lib.resume_position(_TFBackend(), self._window_state(), self.gradient_accumulation_steps, each_replica)

    def _micro_step(self, grads: list, each_replica: Any = None, weight: Any = None) -> None:
        # (Ordered by automatic control dependencies: both touch `mini_step`.)
        with tf.control_dependencies(acc_lib.gradient_tensors(grads)):
            self._resume_position(each_replica)
        acc_lib.micro_step(
            _TFBackend(),
            self._window_state(),
            grads,
            self._apply_inner,
            self._window_length,
            self.reduction,
            each_replica,
            weight=weight,
            replicas=_replicas_in_sync(),
            weighted=weighted_windows(self, weight, _replicas_in_sync()),
        )

    # --------------------------------------------------------- partial window
    # Not converted by AutoGraph (as `apply_gradients`): explicit `tf.cond`s
    # only; converted, `tf.function(opt.flush)` fails to trace.
    @tf.autograph.experimental.do_not_convert
    def flush(self) -> None:
        """Apply the current, partial window now as one update, if it holds
        at least one micro-step; a no-op on an empty window.

        The update is normalised by what the window holds (``"mean"``: its
        micro-steps, or the sum of their counts when weighted; never by N),
        what a large batch of the window's samples would apply; then a new
        window starts. ``iterations`` moves by one, ``micro_steps`` does
        not, and ``mini_step`` restarts at 0. Works eagerly and inside
        ``tf.function``, with or without a ``tf.distribute`` strategy (call
        it in cross-replica context, where ``fit`` is called); runs in the
        strategy the optimizer was created under. A window whose counts sum
        to 0 applies nothing. :func:`accum_optimizer._accumulation.flush`,
        as the Keras 3 family's ``flush``.

        Raises:
            ValueError: called inside ``strategy.run`` (replica context).
        """
        if not getattr(self, "_built", False) or not self._accumulates:
            return
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.flush() must be called in cross-replica "
                "context (outside strategy.run), like model.fit."
            )
        if self._flush_function is None:
            # (One function per optimizer: tf.function's retracing warning
            # would count one shared bound method across instances.)
            self._flush_function = self._no_dependency(tf.function(lambda: self._flush_step(), autograph=False))
        strategy = self._distribution_strategy
        scope = strategy.scope() if strategy is not None and not tf.distribute.has_strategy() else contextlib.nullcontext()
        with scope:
            self._flush_function()

    def _flush_step(self) -> None:
        if not tf.distribute.has_strategy():
            self._flush_window()
            return
        tf.distribute.get_strategy().run(
            lambda: tf.distribute.get_replica_context().merge_call(lambda d: self._flush_window(d))
        )

    def _flush_window(self, distribution: Any = None) -> None:
        each_replica = None if distribution is None else _each_replica_of(distribution)
        self._resume_position(each_replica)
        acc_lib.flush(
            _TFBackend(), self._window_state(), self._apply_inner, self.reduction, each_replica,
            replicas=_replicas_in_sync(), weighted=bool(self.__dict__.get("_weights_seen")),
        )

    def _apply_inner(self, window_grads: list, gates: dict) -> None:
        with self._gate_inner_updates(gates):
            self.inner_optimizer.apply_gradients(
                zip(window_grads, self._trainable_variables),
                skip_gradients_aggregation=self._skip_aggregation,
            )

    @contextlib.contextmanager
    def _gate_inner_updates(self, gates: dict):
        """Skip, per variable, the inner update of variables that had no
        gradient in the window.

        ``gates`` (from :func:`_accumulation.micro_step`) holds, for each
        variable without a gradient on this micro-step, a boolean that is true
        iff it had one earlier in the window. In the large-batch reference
        Keras 2 drops a variable whose gradient is ``None`` before clipping
        (``filter_empty_gradients``): it gets no ``update_step``, no weight
        decay, no EMA update or overwrite, and no constraint. For those
        variables, each of these runs here under a ``tf.cond`` on the gate,
        in the context where Keras 2 runs it (``update_step`` and the EMA in
        the cross-replica apply, weight decay in one ``merge_call`` of its
        own, with Keras 2's per-variable formula inside
        ``distribution.extended.update``). Global state (``iterations``, the
        current learning rate) moves once per update. The inner optimizer's
        own XLA ``update_step`` (``jit_compile``, GPU only) is off for such an
        update, since its compiled function cannot take the gate.

        Under ``MirroredStrategy`` every replica runs this (the replicas'
        gates are equal: they come from the mirrored ``grad_received``); the
        patches stay installed while any replica is inside.
        """
        if not gates:
            yield
            return
        keyed = {self._var_key(self._trainable_variables[i]): g for i, g in gates.items()}
        gating = self._gating
        if gating.depth == 0:
            gating.install(self, keyed)
        gating.depth += 1
        try:
            yield
        finally:
            gating.depth -= 1
            if gating.depth == 0:
                gating.uninstall()

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": self._keras.optimizers.serialize(self.inner_optimizer),
            "gradient_accumulation_steps": serialize_schedule(self._keras, self.gradient_accumulation_steps),
            "reduction": self.reduction,
            # Keras 2's `optimizers.deserialize` reads this to choose between
            # the new and the legacy optimizer classes.
            "is_legacy_optimizer": False,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        config = dict(config)
        inner = config.pop("inner_optimizer")
        if isinstance(inner, dict):
            inner = _deserialize(cls._keras, inner, custom_objects)
        config = deserialize_schedule(cls._keras, config, custom_objects)
        return cls(inner, **config)


def _each_replica_of(distribution: Any) -> Any:
    def each_replica(fn, *args):
        return distribution.extended.call_for_each_replica(fn, args=args)

    return each_replica


def _replicas_in_sync() -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync


class _Gating:
    """The patches of :meth:`_Keras2Accumulating._gate_inner_updates`."""

    def __init__(self) -> None:
        self.depth = 0
        self._undo: list = []

    def install(self, wrapper: Any, gates: dict) -> None:
        opt = wrapper.inner_optimizer
        key = opt._var_key
        orig_update_step = opt.update_step
        orig_weight_decay = opt._apply_weight_decay
        orig_ema = opt._update_model_variables_moving_average
        orig_overwrite = opt._overwrite_model_variables_with_average_value
        plain_weight_decay = wrapper._plain_weight_decay

        def update_step(gradient, variable):
            gate = gates.get(key(variable))
            if gate is None:
                return orig_update_step(gradient, variable)
            return tf.cond(gate, lambda: _none(orig_update_step(gradient, variable)), _noop)

        def apply_weight_decay(variables):
            variables = list(variables)
            orig_weight_decay([v for v in variables if key(v) not in gates])
            gated = [v for v in variables if key(v) in gates]
            if not gated or opt.weight_decay is None:
                return

            def gated_decay(distribution, gated):
                for v in gated:
                    gate = gates[key(v)]

                    def decay(var, gate=gate):
                        # Keras 2's per-variable weight decay (what its
                        # distributed `_apply_weight_decay` runs per device).
                        return tf.cond(gate, lambda: _none(plain_weight_decay(opt, [var])), _noop)

                    distribution.extended.update(v, decay, group=False)

            tf.__internal__.distribute.interim.maybe_merge_call(gated_decay, opt._distribution_strategy, gated)

        def per_variable(orig):
            def gated_fn(var_list):
                var_list = list(var_list)
                orig([v for v in var_list if key(v) not in gates])
                for v in var_list:
                    gate = gates.get(key(v))
                    if gate is not None:
                        tf.cond(gate, lambda v=v: _none(orig([v])), _noop)

            return gated_fn

        patches = {
            "update_step": update_step,
            "_apply_weight_decay": apply_weight_decay,
            "_update_model_variables_moving_average": per_variable(orig_ema),
            "_overwrite_model_variables_with_average_value": per_variable(orig_overwrite),
        }
        for attr, fn in patches.items():
            object.__setattr__(opt, attr, fn)
        jit_compile = opt.jit_compile
        opt.jit_compile = False
        undo = [lambda: [object.__delattr__(opt, a) for a in patches], lambda: setattr(opt, "jit_compile", jit_compile)]
        for v in wrapper._trainable_variables:
            gate = gates.get(key(v))
            constraint = getattr(v, "constraint", None)
            if gate is None or constraint is None:
                continue
            holder = _constraint_holder(v)
            holder._constraint = lambda x, gate=gate, c=constraint: tf.cond(gate, lambda: c(x), lambda: tf.identity(x))
            undo.append(lambda holder=holder, c=constraint: setattr(holder, "_constraint", c))
        self._undo = undo

    def uninstall(self) -> None:
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()


class _TFBackend:
    """:class:`_accumulation.Backend` over ``tf.Variable``s in TF 2 code
    (eager or ``tf.function``, ordered by automatic control dependencies):
    ``IndexedSlices`` become ``scatter_add`` on the replica's own copy of an
    ``ON_READ`` slot, and ``cond`` is ``tf.cond``."""

    def assign(self, variable: Any, value: Any) -> None:
        variable.assign(value, read_value=False)

    def assign_add(self, variable: Any, value: Any) -> None:
        if isinstance(value, tf.IndexedSlices):
            _replica_local(variable).scatter_add(value)
        else:
            variable.assign_add(value, read_value=False)

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> None:
        _replica_local(variable).scatter_update(tf.IndexedSlices(updates, indices))

    def cond(self, pred: Any, true_fn: Any, false_fn: Any) -> None:
        tf.cond(pred, lambda: _none(true_fn()), lambda: _none(false_fn()))


# ------------------------------------------------------------------ helpers
def _deserialize(package: Any, identifier: Any, custom_objects: Any = None) -> Any:
    """An optimizer from a name or a config dict, as ``package`` resolves it.

    ``package.optimizers.get`` first. Keras 2 cannot resolve a
    current-format config (one with ``"module"``, what its ``serialize``
    writes) of a class missing from its ``optimizers.deserialize`` table
    (AdamW in Keras 2.15, Lion and Adafactor in both): it returns the bare
    class name, or raises in the legacy ``.h5`` loader. Such a config is
    then resolved the way Keras 2's current deserializer does it: the
    registered class, else the class ``class_name`` of ``module`` (a
    ``keras.*`` module meaning this package's), built by ``from_config``.
    The identifier is copied first (Keras 2 edits a config dict in place).

    Raises:
        ValueError, KeyError, TypeError: neither way resolves it.
    """
    with package.utils.custom_object_scope(custom_objects or {}):
        try:
            resolved = package.optimizers.get(copy.deepcopy(identifier))
            error = None
        except (ValueError, KeyError, TypeError) as e:
            resolved, error = None, e
        if resolved is not None and not isinstance(resolved, str):
            return resolved
        if not (isinstance(identifier, dict) and "module" in identifier):
            if error is not None:
                raise error
            raise ValueError(f"Could not interpret optimizer identifier: {identifier!r}")
        config = copy.deepcopy(identifier)
        cls = package.saving.get_registered_object(
            config.get("registered_name") or config["class_name"], custom_objects=custom_objects
        )
        if cls is None:
            module = str(config["module"])
            if module == "keras" or module.startswith("keras."):
                owner = package
                for part in module.split(".")[1:]:
                    owner = getattr(owner, part, None)
            else:
                owner = importlib.import_module(module)
            cls = getattr(owner, config["class_name"], None)
        if cls is None:
            if error is not None:
                raise error
            raise ValueError(f"Unknown optimizer: {config['class_name']!r} (module {config['module']!r}).")
        return cls.from_config(config["config"])


def _replica_local(variable: Any) -> Any:
    """This replica's component of a distributed variable (``ON_READ``
    variables support no scatter ops themselves); the variable otherwise."""
    if isinstance(variable, tf.distribute.DistributedValues) and not tf.distribute.in_cross_replica_context():
        return variable._get_on_device_or_primary()
    return variable


def _constraint_holder(variable: Any) -> Any:
    """The object whose ``_constraint`` a variable's ``constraint`` reads
    (the primary of a distributed variable, the variable of an
    ``AutoCastVariable``)."""
    holder = variable
    for _ in range(3):
        if isinstance(holder, tf.distribute.DistributedValues):
            holder = holder._primary
        elif hasattr(holder, "_variable") and not hasattr(holder, "_constraint"):
            holder = holder._variable
        else:
            break
    return holder


def _none(_: Any) -> None:
    return None


def _noop() -> None:
    return None


def _shared_name(variable: Any) -> str:
    name = getattr(variable, "_shared_name", None)
    return name if name else variable.name.split(":")[0]


def _is_tensor_like(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.IndexedSlices, tf.Variable)) or tf.is_tensor(value)


def _op_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in name)


AccumulatingOptimizer = wrapper_class(_default_package())
