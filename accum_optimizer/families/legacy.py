"""`AccumulatingOptimizer` for Keras 2 legacy ``OptimizerV2`` and tensorflow-addons.

Wraps any ``tf.keras.optimizers.legacy.Optimizer`` of a Keras 2 package
(``keras`` 2.x on TF <= 2.15, or ``tf_keras``): the built-in legacy
optimizers and every tensorflow-addons optimizer (tfa's optimizers are
``OptimizerV2`` subclasses, tfa's ``Lookahead``, ``MovingAverage``, ``SWA`` and
``MultiOptimizer`` included). The wrapper is itself an ``OptimizerV2`` of the
inner optimizer's package (one class per Keras 2 package, built by
:func:`wrapper_class`), so that package's ``model.compile`` accepts it.

Design: the override is at the level of ``apply_gradients``, not of the
per-variable hooks (``_create_slots``, ``_prepare_local``,
``_resource_apply_*``) that tfa's ``average_wrapper.py`` and ``Lookahead``
delegate. ``OptimizerV2.apply_gradients`` all-reduces the gradients,
clips them and increments ``iterations`` *before and around* the
per-variable hooks, so a hook-level wrapper would all-reduce and clip every
micro-step and count micro-steps. Overriding ``apply_gradients`` keeps all of
that in the inner optimizer's own ``apply_gradients``, called once per update
(in each replica, with that replica's window gradient), as in Keras 3's
adapter (:mod:`accum_optimizer.families.keras3`): one ``merge_call`` per
micro-step under ``MirroredStrategy``, per-replica (``ON_READ``)
accumulators, the ``cond`` on update steps in cross-replica context. The
per-variable hooks of the wrapper refuse to run: a tfa wrapper *around* this
one (``Lookahead(AccumulatingOptimizer(...))``) would drive them every
micro-step, so it gets a clear error before any weight moves.

The algorithm is :func:`accum_optimizer._accumulation.micro_step`; this module
only supplies the variables, a :class:`_Backend` and the call of the inner
optimizer.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Iterable, Sequence

import numpy as np
import tensorflow as tf

from accum_optimizer import _accumulation as acc_lib
from accum_optimizer import _dispatch
from accum_optimizer.families._keras2_common import deserialize_schedule, serialize_schedule, weighted_windows

# Arguments of `OptimizerV2.__init__` (and of common subclasses) that belong on
# the inner optimizer, with their defaults (accepted when equal to the
# default, so that configs written by generic code still load).
_INNER_ONLY_ARGS = {
    "learning_rate": None,
    "lr": None,
    "decay": 0.0,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "gradient_aggregator": None,
    "gradient_transformers": None,
}

# Written by Keras 2's `optimizers.serialize` into every legacy optimizer's
# config; not an argument.
_IGNORED_CONFIG_KEYS = ("is_legacy_optimizer",)

_WRAP_OUTSIDE = (
    "AccumulatingOptimizer cannot be the inner optimizer of an optimizer "
    "wrapper that calls its per-variable update hooks ({hook}), such as "
    "tensorflow-addons' Lookahead, MovingAverage or SWA: that wrapper would "
    "drive the update on every micro-step and count micro-steps. Put the "
    "accumulation outside instead, where those wrappers see updates: "
    "AccumulatingOptimizer(tfa.optimizers.Lookahead(inner), "
    "gradient_accumulation_steps=N)."
)

_CLASSES: dict[str, type] = {}


def _legacy_base(package: Any) -> type:
    return package.optimizers.legacy.Optimizer


def package_of(optimizer: Any) -> Any:
    """The imported Keras 2 package whose legacy ``Optimizer`` ``optimizer``
    is an instance of (``keras`` 2.x or ``tf_keras``), or ``None``."""
    for package in _dispatch._keras2_packages():
        legacy = getattr(getattr(package, "optimizers", None), "legacy", None)
        if legacy is not None and isinstance(optimizer, legacy.Optimizer):
            return package
    return None


def _primary_package() -> Any:
    """The Keras 2 package the module-level class is built on: the active
    ``tf.keras`` if it is Keras 2, else an imported Keras 2 package
    (``tf_keras`` first), else ``tf_keras`` if it imports.

    Raises:
        ImportError: no Keras 2 package is available.
    """
    kind, package = _dispatch.active_keras()
    if kind == "keras2":
        return package
    imported = _dispatch._keras2_packages()
    if imported:
        return imported[0]
    try:
        import tf_keras

        return tf_keras
    except ImportError:
        raise ImportError(
            "accum_optimizer.families.legacy needs Keras 2: tf.keras on "
            "TensorFlow <= 2.15, or the tf_keras package (pip install tf_keras, "
            "with TF_USE_LEGACY_KERAS=1 to make it tf.keras)."
        ) from None


def _var_key_fn(package: Any):
    """``optimizer_v2._var_key`` of ``package``: the key its optimizers index
    slots with (the distributed container's key for a replica's component)."""
    return sys.modules[_legacy_base(package).__module__]._var_key


def _resolve_inner(inner_optimizer: Any, package: Any) -> Any:
    base = _legacy_base(package)
    if isinstance(inner_optimizer, (str, dict)):
        try:
            # optimizers.get edits a config dict in place: pass a copy.
            inner_optimizer = package.optimizers.get(
                copy.deepcopy(inner_optimizer), use_legacy_optimizer=True
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"`inner_optimizer` could not be resolved by {package.__name__}"
                ".optimizers.get(..., use_legacy_optimizer=True). Received: "
                f"inner_optimizer={inner_optimizer!r}. ({e})"
            ) from None
    if isinstance(inner_optimizer, _LegacyAccumulating):
        raise ValueError(
            "`inner_optimizer` is already an AccumulatingOptimizer "
            f"(gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps}); nesting them "
            "would accumulate twice. Use one AccumulatingOptimizer with "
            "gradient_accumulation_steps equal to the product."
        )
    if not isinstance(inner_optimizer, base):
        kind = type(inner_optimizer)
        raise TypeError(
            "`inner_optimizer` must be a Keras 2 legacy optimizer instance "
            f"({package.__name__}.optimizers.legacy.Optimizer, e.g. "
            f"{package.__name__}.optimizers.legacy.Adam(), or a "
            "tensorflow-addons optimizer) or an identifier that "
            f"`{package.__name__}.optimizers.get` resolves (e.g. 'adam'). "
            f"Received: inner_optimizer={inner_optimizer!r} of type "
            f"{kind.__module__}.{kind.__qualname__}."
        )
    lso = getattr(getattr(package, "mixed_precision", None), "LossScaleOptimizer", None)
    if lso is not None and isinstance(inner_optimizer, lso):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer (received "
            f"inner_optimizer={inner_optimizer!r}). Put the loss scaling "
            "outside: LossScaleOptimizer(AccumulatingOptimizer(inner, N)). "
            "Under the 'mixed_float16' policy, model.compile does that by "
            "itself; with a LossScaleOptimizer inside, it would wrap a second "
            "one around the first and unscale the gradients twice."
        )
    return inner_optimizer


class _LegacyAccumulating:
    """Accumulate gradients over micro-batches, update once per window.

    Each call to :meth:`apply_gradients` (``minimize``, ``model.fit``'s train
    step) is one *micro-step*: the gradients are added into accumulator
    variables (one per trainable variable, same shape and dtype). On every
    ``gradient_accumulation_steps``-th micro-step the inner optimizer's own
    ``apply_gradients`` is called once with the window's gradient (the mean,
    or the sum, of the accumulated micro-batch gradients) and the
    accumulators are zeroed. Between updates the model weights and all of
    the inner optimizer's state (slots, ``iterations``, hyperparameters,
    tfa's Lookahead slow weights and MovingAverage/SWA averages) stay
    bitwise untouched, so ``N`` micro-batches of ``B`` samples train exactly
    like one batch of ``N * B`` samples when the loss is a mean over the
    batch.

    Args:
        inner_optimizer: a legacy ``OptimizerV2`` of this class' Keras 2
            package (``tf.keras.optimizers.legacy.*``, a tensorflow-addons
            optimizer, tfa's ``Lookahead``/``MovingAverage``/``SWA``/
            ``MultiOptimizer`` around one), or an identifier that
            ``optimizers.get(..., use_legacy_optimizer=True)`` resolves.
            Clipping, weight decay and learning-rate schedules go on it; they
            act once per update on the window's gradient, and schedules see
            update counts.
        gradient_accumulation_steps: ``int >= 1``, the number ``N`` of
            micro-steps per update. ``1`` is a pass-through to the inner
            optimizer (no accumulators are created). Or a schedule over
            updates: a dict ``{first_update: N, ...}`` (piecewise constant,
            int keys strictly ascending from 0; kept in ``get_config``) or a
            callable ``update_index -> N`` (an int64 scalar tensor in, an int
            or int scalar tensor out; ``get_config`` needs it registered with
            the package's ``register_keras_serializable``): a window that
            starts at update ``u`` has ``N(u)`` micro-steps.
        reduction: ``"mean"`` (default) applies ``sum / N``, equivalent to the
            large batch for a mean-reduced loss; ``"sum"`` applies the sum.
        name: optional name of the wrapper.

    State (variables of the wrapper, in :attr:`weights` before the inner
    optimizer's, saved wherever Keras 2 saves optimizer weights):
        ``micro_steps``: int64 scalar, micro-steps taken (units: micro-steps).
        ``iterations``: the inner optimizer's int64 counter, i.e. updates
            taken (units: updates). After ``m`` micro-steps,
            ``iterations == m // N`` and ``micro_steps == m``.
        ``acc_grads``: accumulators, shape and dtype of each trainable
            variable; ``ON_READ`` (summed on read) under ``tf.distribute``:
            each replica adds its local gradients, and the one cross-replica
            reduction per update is the inner optimizer's own all-reduce.
        ``grad_received``: int64 ``(num_trainable_variables,)``, 1 where a
            variable has had a gradient in the current window.
        ``touched_rows``: per variable of rank >= 1, a float16
            ``(shape[0],)`` vector marking the rows that sparse gradients
            touched in the window (2 bytes per row; float so that a summed
            ``ON_READ`` mark survives a restore across replicas).
        ``mini_step``: int64 scalar, micro-steps in the current window (its
            position); -1 until the first micro-step or :meth:`flush`
            ("unknown": then ``micro_steps % N``, what it was in weights
            saved before it existed).
        ``window_weight``: float32 scalar, the window's ``Σ cᵢ`` (each
            micro-step's ``weight``, 1 without one); ``ON_READ`` summed
            under ``tf.distribute``.
        (Those two come last in :attr:`weights`, after the inner
        optimizer's: weights saved without them restore.)

    Weighted micro-batches (``apply_gradients(..., weight=c)``), the partial
    window (:meth:`flush`) and schedules follow the Keras 3 family; the
    window's gradient is ``Σ cᵢ·gᵢ / Σ cᵢ`` under ``"mean"``.

    Sparse gradients (``tf.IndexedSlices``, from ``Embedding``) are
    scatter-added, never densified per micro-step, and the update hands the
    inner optimizer ``tf.IndexedSlices`` over the window's touched rows (each
    once, summed): lazy optimizers (tfa ``LazyAdam``, momentum ``SGD``) then
    leave the rows no micro-batch looked up untouched, as in the sparse
    large-batch reference.

    Missing gradients: a ``None`` gradient adds nothing on that micro-step;
    a variable with no gradient in the whole window is not updated (not its
    weight, its slots, its tfa decoupled weight decay, nor its constraint).

    The inner optimizer's slots are its own: ``opt.inner_optimizer.get_slot(
    var, "m")``; the wrapper has no slots of its own (forwarding them would
    save each one twice in a ``tf.train.Checkpoint``).

    Raises:
        TypeError: ``inner_optimizer`` is not a legacy optimizer of this
            package, ``gradient_accumulation_steps`` is not an int, dict or
            callable (or a schedule key or value is not an int), or an
            unknown keyword argument is passed.
        ValueError: ``gradient_accumulation_steps < 1`` (or a schedule's N,
            or its keys not strictly ascending from 0); ``reduction`` not in
            ``("mean", "sum")``; the inner optimizer already accumulates or
            is a ``LossScaleOptimizer``; base-optimizer arguments
            (``clipnorm``, ``learning_rate``, ...) passed to the wrapper
            instead of the inner optimizer.
        RuntimeError: a wrapper such as tfa's ``Lookahead`` is placed
            *around* this optimizer (raised at its first ``apply_gradients``,
            before any variable changes).
    """

    _HAS_AGGREGATE_GRAD = True
    _keras: Any = None  # the Keras 2 package, set by `wrapper_class`

    def __new__(cls, inner_optimizer: Any = acc_lib.REQUIRED, *args: Any, **kwargs: Any):
        # An inner optimizer of another imported Keras 2 package (tf_keras
        # beside TF 2.15's keras) gets that package's wrapper class.
        package = package_of(inner_optimizer)
        if package is not None and package is not cls._keras:
            return wrapper_class(package)(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        inner_optimizer: Any = acc_lib.REQUIRED,
        gradient_accumulation_steps: int = acc_lib.REQUIRED,
        reduction: str = "mean",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        for key in _IGNORED_CONFIG_KEYS:
            kwargs.pop(key, None)
        for arg, default in _INNER_ONLY_ARGS.items():
            if arg not in kwargs:
                continue
            value = kwargs.pop(arg)
            if value is not None and not _equal(value, default):
                raise ValueError(
                    f"AccumulatingOptimizer does not take `{arg}` (received "
                    f"{arg}={value!r}). Set it on the inner optimizer, e.g. "
                    f"{self._keras.__name__}.optimizers.legacy.Adam({arg}=...), "
                    "where it acts once per update on the window's gradient."
                )
        acc_lib.check_arguments(inner_optimizer, gradient_accumulation_steps, kwargs)
        steps = acc_lib.validate_accumulation_schedule(gradient_accumulation_steps)
        reduction = acc_lib.validate_reduction(reduction)
        inner = _resolve_inner(inner_optimizer, self._keras)
        super().__init__(name)
        self._hypers_created = True  # the wrapper has no hyperparameters of its own
        self.inner_optimizer = inner
        self._track_trackable(inner, "inner_optimizer")
        self.gradient_accumulation_steps = steps
        self._window_length = acc_lib.window_length(steps)
        self._window_weights: list = []
        self._flush_function = None
        self.mini_step = self.window_weight = None
        self.reduction = reduction
        self._built = False
        self._sparse_seen: set[int] = set()
        self._gating_depth = 0
        self._gating_undo: Any = None
        self._var_key = _var_key_fn(self._keras)

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulators, counters and the inner optimizer's
        variables for ``var_list`` (the trainable variables, in the order
        that defines the accumulators). Runs once; later calls do nothing.
        Keras 2 calls it as ``_create_all_weights`` when it loads optimizer
        weights from an ``.h5`` file."""
        if self._built:
            return
        var_list = list(var_list)
        with tf.init_scope(), self._distribution_strategy_scope():
            strategy = tf.distribute.get_strategy()
            self._index = {self._var_key(v): i for i, v in enumerate(var_list)}
            self._trainable = var_list
            first = tf.VariableAggregation.ONLY_FIRST_REPLICA
            self.micro_steps = self.add_weight(
                "micro_steps", shape=[], dtype=tf.int64, trainable=False, aggregation=first
            )
            own = [self.micro_steps]
            self.acc_grads, self.touched_rows, self.grad_received = [], [], None
            if self._accumulates:
                self.grad_received = self.add_weight(
                    "grad_received", shape=[len(var_list)], dtype=tf.int64, trainable=False,
                    aggregation=first,
                )
                own.append(self.grad_received)
                for i, v in enumerate(var_list):
                    with strategy.extended.colocate_vars_with(v):
                        self.acc_grads.append(self._replica_local(f"acc_grad_{i}", v.shape, v.dtype))
                        rows = None
                        if v.shape.rank:
                            rows = self._replica_local(f"touched_rows_{i}", v.shape[:1], tf.float16)
                        self.touched_rows.append(rows)
                own += self.acc_grads + [r for r in self.touched_rows if r is not None]
                # The window's position and count, after the inner
                # optimizer's weights (weights saved without them, by
                # 0.2.0.dev0 and older, are a prefix). `mini_step` starts at
                # -1, "unknown": the first micro-step or flush sets it to
                # `micro_steps % N` (`_accumulation.resume_position`), so that
                # a checkpoint saved without it resumes exactly.
                self.mini_step = self.add_weight(
                    "mini_step", shape=[], dtype=tf.int64, trainable=False, aggregation=first,
                    initializer=_unknown_position,
                )
                self.window_weight = self._replica_local("window_weight", [], tf.float32)
                self._window_weights[:] = [self.mini_step, self.window_weight]
            self._weights.extend(own)
            self.inner_optimizer._create_all_weights(var_list)
        self._built = True

    def _replica_local(self, name: str, shape: Any, dtype: Any) -> Any:
        return self.add_weight(
            name, shape=shape, dtype=dtype, trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )

    def _create_all_weights(self, var_list: Sequence[Any]) -> None:
        self.build(var_list)

    @property
    def _accumulates(self) -> bool:
        """Whether micro-steps go through windows (else: the pass-through)."""
        steps = self.gradient_accumulation_steps
        return not isinstance(steps, int) or steps > 1

    @property
    def weights(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        accumulators, row trackers), the inner optimizer's, then
        ``mini_step`` and ``window_weight``."""
        return self._weights + list(self.inner_optimizer.weights) + self._window_weights

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`weights`), as
        ``OptimizerV2.set_weights``; weights saved before ``mini_step`` and
        ``window_weight`` existed (0.2.0.dev0 and older: all but those two)
        are accepted too, and the window's position is then
        ``micro_steps % N`` again.

        Raises:
            ValueError: the number or shapes of ``weights`` do not match.
        """
        weights = list(weights)
        window = len(self._window_weights)
        if not window or len(weights) != len(self.weights) - window:
            super().set_weights(weights)
            return
        params = self.weights[: len(weights)]
        for p, w in zip(params, weights):
            if tuple(p.shape) != tuple(np.shape(w)):
                raise ValueError(
                    f"Optimizer weight {p.name!r} has shape {tuple(p.shape)}; "
                    f"received a weight of shape {tuple(np.shape(w))}."
                )
        for p, w in zip(params, weights):
            p.assign(w)
        self.mini_step.assign(acc_lib.UNKNOWN_POSITION)
        self.window_weight.assign(0.0)

    def variables(self) -> list:
        return self.weights

    @property
    def iterations(self) -> Any:
        """Updates taken: the inner optimizer's int64 ``iterations``."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable: Any) -> None:
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (getter and setter; a variable,
        or its schedule)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    # `lr`: what Keras 2's LearningRateScheduler and ReduceLROnPlateau read
    # and write (OptimizerV2.__setattr__ also maps `lr` to `learning_rate`).
    lr = learning_rate

    # Refused hooks: only an optimizer wrapped *around* this one calls them.
    def _create_slots(self, var_list: Any) -> None:
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_create_slots"))

    def _prepare(self, var_list: Any) -> Any:
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_prepare"))

    def _prepare_local(self, var_device: Any, var_dtype: Any, apply_state: Any) -> None:
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_prepare_local"))

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_resource_apply_dense"))

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_resource_apply_sparse"))

    def _resource_apply_sparse_duplicate_indices(self, grad, var, indices, apply_state=None):
        raise RuntimeError(_WRAP_OUTSIDE.format(hook="_resource_apply_sparse_duplicate_indices"))

    # ------------------------------------------------------------ micro-step
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        name: str | None = None,
        experimental_aggregate_gradients: bool = True,
        weight: Any = None,
    ) -> Any:
        """Take one micro-step with ``grads_and_vars``.

        ``(gradient, variable)`` pairs as for ``OptimizerV2.apply_gradients``:
        a dense tensor of the variable's shape, a ``tf.IndexedSlices``, or
        ``None`` (no contribution this micro-step). The first call fixes the
        set of variables; later calls may pass a subset. With
        ``experimental_aggregate_gradients=False`` the gradients are taken
        as already summed over replicas, and the inner optimizer is told so
        at each update.

        ``weight``: the micro-batch's count ``c``, what its mean loss was
        taken over (samples, sum of sample weights, unmasked tokens): a
        Python number or a scalar tensor >= 0, finite; it may differ per
        micro-step (:func:`accum_optimizer._accumulation.check_weight`). The
        window applies ``Σ cᵢ·gᵢ / Σ cᵢ`` (``"mean"``) or ``Σ cᵢ·gᵢ``
        (``"sum"``); a window whose counts sum to 0 applies nothing (the
        inner optimizer is not called, ``iterations`` does not move).
        ``None`` (default): 1, the unweighted window. Under ``tf.distribute``
        each replica passes its own count, and its gradient is its mean
        loss's divided by the replica count, as ``fit`` forms it. The Keras 3
        family's semantics.

        Returns:
            ``None`` (the update is a ``tf.cond`` inside; read
            :attr:`iterations` and :attr:`micro_steps` for progress).

        Raises:
            ValueError: every gradient is ``None``; a gradient's shape differs
                from its variable's; a variable is not among those of the
                first call; called in cross-replica context; ``weight`` is not
                a scalar, is negative or not finite (inside ``tf.function``:
                ``InvalidArgumentError`` when the step runs, before any state
                changes).
            TypeError: ``weight`` is not a number.
        """
        weight = acc_lib.check_weight(weight)
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return None
        grads, variables = (list(t) for t in zip(*grads_and_vars))
        grads = [
            g if g is None or isinstance(g, tf.IndexedSlices) or tf.is_tensor(g)
            else tf.convert_to_tensor(g, dtype=v.dtype)
            for g, v in zip(grads, variables)
        ]
        acc_lib.validate_gradient_shapes(grads, variables, _name)
        if all(g is None for g in grads):
            raise ValueError(f"No gradients provided for any variable: {[_name(v) for v in variables]}.")
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.apply_gradients() must be called in a "
                "replica context (e.g. inside strategy.run), not cross-replica "
                "context."
            )
        self.build(variables)
        unknown = [_name(v) for v in variables if self._var_key(v) not in self._index]
        if unknown:
            raise ValueError(
                f"Variables {unknown} were not among the variables of the first "
                "apply_gradients() call, for which the accumulators were "
                f"built ({len(self._trainable)} variables). Pass every trainable "
                "variable in the first call (a None gradient is fine)."
            )
        self._aggregate = bool(experimental_aggregate_gradients)
        if not self._accumulates:
            # Pass-through; its writes, too, wait for the gradients (see
            # `_accumulation`: a phantom call at the end of an input of
            # unknown length must not count).
            with tf.control_dependencies(acc_lib.gradient_tensors(grads + [weight])):
                if weight is not None and self.reduction == "sum":
                    grads = [None if g is None else acc_lib.scaled(g, weight) for g in grads]
                pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
                if weight is None:
                    self.inner_optimizer.apply_gradients(pairs, **self._inner_kwargs())
                else:
                    # A window of one micro-step: c·g/c = g ("mean") or c·g
                    # ("sum"); a count of 0 applies nothing.
                    tf.cond(
                        weight > 0,
                        lambda: _none(self.inner_optimizer.apply_gradients(pairs, **self._inner_kwargs())),
                        lambda: None,
                    )
                self.micro_steps.assign_add(1)
            return None
        full = [None] * len(self._trainable)
        for g, v in zip(grads, variables):
            full[self._index[self._var_key(v)]] = g
        # Shapes unknown at trace time are checked when the step runs, before
        # any state changes: the check gates every write of this micro-step.
        checked = [
            g if g is None or isinstance(g, tf.IndexedSlices) or g.shape.is_fully_defined()
            else tf.ensure_shape(g, v.shape, name="gradient_shape_check")
            for g, v in zip(full, self._trainable)
        ]
        if not tf.distribute.has_strategy() or tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._micro_step(checked, weight=weight)
        else:
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_step, args=(checked,), kwargs={"weight": weight}
            )
        return None

    def _inner_kwargs(self) -> dict:
        return {} if self._aggregate else {"experimental_aggregate_gradients": False}

    def _cross_replica_step(self, distribution: Any, grads: list, weight: Any = None) -> None:
        # Runs once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        self._micro_step(grads, _each_replica_of(distribution), weight)

    def _window_state(self, rows: Any = None) -> acc_lib.WindowState:
        return acc_lib.WindowState(
            self.acc_grads, self.micro_steps, self.grad_received, rows,
            mini_step=self.mini_step, window_weight=self.window_weight, updates=self.inner_optimizer.iterations,
        )

    def _sparse_rows(self) -> list:
        return [t if i in self._sparse_seen else None for i, t in enumerate(self.touched_rows)]

    def _micro_step(self, grads: list, each_replica: Any = None, weight: Any = None) -> None:
        # Row trackers are exposed only for variables that have had sparse
        # gradients (remembered at trace time): `_accumulation.sparse_window`
        # hands a tracked variable without a gradient on the closing
        # micro-step a sparse window, which a dense variable (one with a
        # constraint, say) must not get.
        for i, g in enumerate(grads):
            if isinstance(acc_lib._local(g), tf.IndexedSlices):
                self._sparse_seen.add(i)
        state = self._window_state(self._sparse_rows())
        # (Ordered by automatic control dependencies: both touch `mini_step`.)
        with tf.control_dependencies(acc_lib.gradient_tensors(grads)):
            acc_lib.resume_position(_Backend(), state, self.gradient_accumulation_steps, each_replica)
        acc_lib.micro_step(
            _Backend(),
            state,
            grads,
            self._apply_inner,
            self._window_length,
            self.reduction,
            each_replica,
            weight=weight,
            replicas=tf.distribute.get_strategy().num_replicas_in_sync,
            weighted=weighted_windows(self, weight, tf.distribute.get_strategy().num_replicas_in_sync),
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
        strategy the optimizer was created under. Variables that had sparse
        gradients get the sparse window over their touched rows, as at a
        window's last micro-step. A window whose counts sum to 0 applies
        nothing. :func:`accum_optimizer._accumulation.flush`, as the Keras 3
        family's ``flush``.

        Raises:
            ValueError: called inside ``strategy.run`` (replica context).
        """
        if not self._built or not self._accumulates:
            return
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.flush() must be called in cross-replica "
                "context (outside strategy.run), like model.fit."
            )
        if self._flush_function is None:
            # (One function per optimizer: tf.function's retracing warning
            # would count one shared bound method across instances.)
            self._flush_function = tf.function(lambda: self._flush_step(), autograph=False)
        with self._distribution_strategy_scope():
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
        self._aggregate = getattr(self, "_aggregate", True)
        state = self._window_state(self._sparse_rows())
        acc_lib.resume_position(_Backend(), state, self.gradient_accumulation_steps, each_replica)
        acc_lib.flush(
            _Backend(), state, self._apply_inner, self.reduction, each_replica,
            replicas=tf.distribute.get_strategy().num_replicas_in_sync,
            weighted=bool(self.__dict__.get("_weights_seen")),
        )

    def _apply_inner(self, window_grads: list, gates: dict) -> None:
        with self._gate_inner_updates(gates):
            self.inner_optimizer.apply_gradients(list(zip(window_grads, self._trainable)), **self._inner_kwargs())

    @contextlib.contextmanager
    def _gate_inner_updates(self, gates: dict):
        """Skip, per variable, the inner update of variables that had no
        gradient in the window.

        ``gates`` (from :func:`_accumulation.micro_step`) holds, for each
        variable without a gradient on this micro-step, a boolean that is true
        iff it had one earlier in the window. For those variables the
        per-variable update (``_resource_apply_dense`` /
        ``_resource_apply_sparse_duplicate_indices``, which in tfa include the
        decoupled weight decay, Lookahead's sync and MovingAverage's average)
        and the variable's constraint run under a ``tf.cond`` on it, in the
        inner optimizer and in the optimizers it hands gradients to
        (tfa ``MultiOptimizer``). Global state (``iterations``) moves once per
        update, as in the large-batch reference.
        """
        if not gates:
            yield
            return
        # Under MirroredStrategy every replica runs this, interleaved at the
        # inner optimizer's merge_call: the patches are installed by the
        # first replica to enter (its gates: the replicas' gates are equal,
        # they come from the mirrored `grad_received`) and removed when the
        # last one leaves.
        if self._gating_depth == 0:
            self._gating_undo = self._install_gates(gates)
        self._gating_depth += 1
        try:
            yield
        finally:
            self._gating_depth -= 1
            if self._gating_depth == 0:
                undo, self._gating_undo = self._gating_undo, []
                undo()

    def _install_gates(self, gates: dict) -> Any:
        """Install the patches of :meth:`_gate_inner_updates`; return the
        function that removes them."""
        gates = {self._var_key(self._trainable[i]): g for i, g in gates.items()}
        patched = []
        for opt in _optimizer_tree(self.inner_optimizer):
            # Keras caches the hooks' argument lists per instance; fill the
            # cache from the real methods before shadowing them.
            _ = opt._dense_apply_args, opt._sparse_apply_args
            patched.append(opt)
            object.__setattr__(opt, "_resource_apply_dense", _gated(opt._resource_apply_dense, gates, self._var_key))
            object.__setattr__(
                opt,
                "_resource_apply_sparse_duplicate_indices",
                _gated(opt._resource_apply_sparse_duplicate_indices, gates, self._var_key),
            )
        constrained = []
        for v in self._trainable:
            gate = gates.get(self._var_key(v))
            if gate is None or getattr(v, "constraint", None) is None:
                continue
            for component in getattr(v, "values", None) or [v]:
                c = component._constraint
                constrained.append((component, c))
                component._constraint = lambda x, gate=gate, c=c: tf.cond(gate, lambda: c(x), lambda: tf.identity(x))

        def undo() -> None:
            for opt in patched:
                object.__delattr__(opt, "_resource_apply_dense")
                object.__delattr__(opt, "_resource_apply_sparse_duplicate_indices")
            for component, c in constrained:
                component._constraint = c

        return undo

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self._name,
            "inner_optimizer": self._keras.optimizers.serialize(self.inner_optimizer),
            "gradient_accumulation_steps": serialize_schedule(self._keras, self.gradient_accumulation_steps),
            "reduction": self.reduction,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        config = dict(config)
        inner = config.pop("inner_optimizer")
        if isinstance(inner, dict):
            # deserialize lower-cases the class name in place: pass a copy.
            inner = cls._keras.optimizers.deserialize(
                copy.deepcopy(inner), custom_objects=custom_objects, use_legacy_optimizer=True
            )
        config = deserialize_schedule(cls._keras, config, custom_objects)
        return cls(inner, **config)


class _Backend:
    """:class:`_accumulation.Backend` for ``tf.Variable``s in TF2 (eager or
    ``tf.function``; ordering by automatic control dependencies), replica-local
    variables included: ``IndexedSlices`` become a scatter-add.

    Scatters go to the resource ``handle``: replica-local (``ON_READ``)
    variables have no ``scatter_add``/``scatter_update``, but in replica
    context their ``handle`` is the local replica's variable."""

    def assign(self, variable: Any, value: Any) -> None:
        variable.assign(value, read_value=False)

    def assign_add(self, variable: Any, value: Any) -> None:
        if isinstance(value, tf.IndexedSlices):
            tf.raw_ops.ResourceScatterAdd(
                resource=variable.handle, indices=value.indices, updates=tf.cast(value.values, variable.dtype)
            )
        else:
            variable.assign_add(value, read_value=False)

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> None:
        tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=indices, updates=tf.cast(updates, variable.dtype)
        )

    def cond(self, pred: Any, true_fn: Any, false_fn: Any) -> None:
        tf.cond(pred, lambda: _none(true_fn()), lambda: _none(false_fn()))


def _none(_: Any) -> None:
    return None


def _unknown_position(shape: Any, dtype: Any = tf.int64, **kwargs: Any) -> Any:
    """Initializer of ``mini_step``: :data:`_accumulation.UNKNOWN_POSITION`."""
    return tf.fill(shape, tf.constant(acc_lib.UNKNOWN_POSITION, dtype))


def _each_replica_of(distribution: Any) -> Any:
    def each_replica(fn, *args):
        return distribution.extended.call_for_each_replica(fn, args=args)

    return each_replica


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays, schedules: not a default
        return False


def _name(variable: Any) -> str:
    return getattr(variable, "name", repr(variable))


def _optimizer_tree(opt: Any) -> list:
    """``opt`` and the optimizers whose ``apply_gradients`` it calls (tfa
    ``MultiOptimizer``'s ``optimizer_specs``)."""
    found = [opt]
    for spec in getattr(opt, "optimizer_specs", None) or []:
        found += _optimizer_tree(spec["optimizer"])
    return found


def _gated(orig: Any, gates: dict, var_key: Any):
    """``orig(grad, var, ...)`` under ``tf.cond(gate)`` for gated variables."""

    def hook(grad, var, *args, **kwargs):
        gate = gates.get(var_key(var))
        if gate is None:
            return orig(grad, var, *args, **kwargs)
        return tf.cond(gate, lambda: tf.group(orig(grad, var, *args, **kwargs)), tf.no_op)

    return hook


def wrapper_class(package: Any) -> type:
    """The ``AccumulatingOptimizer`` class for a Keras 2 package (``keras``
    2.x or ``tf_keras``): a subclass of its ``optimizers.legacy.Optimizer``,
    registered with its ``register_keras_serializable`` as
    ``"accum_optimizer>LegacyAccumulatingOptimizer"``. Built once per package."""
    cls = _CLASSES.get(package.__name__)
    if cls is None:
        cls = type(
            "AccumulatingOptimizer",
            (_LegacyAccumulating, _legacy_base(package)),
            {"__module__": __name__, "__qualname__": "AccumulatingOptimizer", "_keras": package,
             "__doc__": _LegacyAccumulating.__doc__},
        )
        cls = package.utils.register_keras_serializable(
            package="accum_optimizer", name="LegacyAccumulatingOptimizer"
        )(cls)
        _CLASSES[package.__name__] = cls
    return cls


#: The wrapper class of the primary Keras 2 package (see :func:`_primary_package`).
AccumulatingOptimizer = wrapper_class(_primary_package())
