"""`AccumulatingOptimizer`: gradient accumulation for Keras 3.

Modelled on Keras 3's ``keras.optimizers.LossScaleOptimizer``
(``keras/src/optimizers/loss_scale_optimizer.py``): a wrapper with its own
variables plus the inner optimizer's, forwarding ``learning_rate``,
``iterations`` and ``scale_loss``, serializing the inner optimizer in
``get_config``, and keeping the TensorFlow-specific distribution code in one
method (:meth:`AccumulatingOptimizer._tf_apply`). The algorithm itself lives in
:mod:`accum_optimizer._accumulation`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import sys
import weakref
from typing import Any, Iterable, Mapping, Sequence

import keras
import numpy as np
from keras import ops

from accum_optimizer import _accumulation as acc_lib

# Arguments of `keras.optimizers.Optimizer.__init__` that belong on the inner
# optimizer, with their defaults (accepted when equal to the default, so that
# configs written by generic code still load).
_INNER_ONLY_ARGS = {
    "learning_rate": None,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
}


def _resolve_inner(inner_optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(inner_optimizer, (str, dict)):
        try:
            # keras.optimizers.get edits a config dict in place: pass a copy.
            inner_optimizer = keras.optimizers.get(copy.deepcopy(inner_optimizer))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                "`inner_optimizer` could not be resolved by "
                f"keras.optimizers.get. Received: inner_optimizer="
                f"{inner_optimizer!r}. ({e})"
            ) from None
    if isinstance(inner_optimizer, AccumulatingOptimizer):
        raise ValueError(
            "`inner_optimizer` is already an AccumulatingOptimizer "
            f"(gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps}); nesting them "
            "would accumulate twice. Use one AccumulatingOptimizer with "
            "gradient_accumulation_steps equal to the product."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a Keras 3 optimizer instance "
            "(`keras.optimizers.Optimizer`, e.g. keras.optimizers.Adam()) or "
            "an identifier that `keras.optimizers.get` resolves (e.g. "
            f"'adam'). Received: inner_optimizer={inner_optimizer!r} of type "
            f"{type(inner_optimizer).__module__}.{type(inner_optimizer).__qualname__}."
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer (received "
            f"inner_optimizer={inner_optimizer!r}). Put the loss scaling "
            "outside: LossScaleOptimizer(AccumulatingOptimizer(inner, N)). "
            "Under the 'mixed_float16' policy, model.compile does that by "
            "itself; with a LossScaleOptimizer inside, it would wrap a second "
            "one around the first and unscale the gradients twice."
        )
    if getattr(inner_optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "`inner_optimizer` already uses Keras' built-in gradient "
            "accumulation (inner_optimizer.gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps}); wrapping it "
            "would accumulate twice. Create the inner optimizer without "
            "`gradient_accumulation_steps` and pass that value to "
            "AccumulatingOptimizer instead."
        )
    return inner_optimizer


_GATE_LOCK = threading.Lock()


def _forwarded(name: str, writable: bool = True) -> property:
    """A property answered by the inner optimizer (``AttributeError`` where it
    has no such attribute, so ``hasattr`` tells the truth). Before the inner
    optimizer is set (inside Keras' base ``__init__``), values are kept aside
    and never reach it: they are the base class's defaults for the wrapper."""

    def fget(self: Any) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            try:
                return self.__dict__["_before_inner"][name]
            except KeyError:
                raise AttributeError(name) from None
        return getattr(inner, name)

    def fset(self: Any, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            self.__dict__.setdefault("_before_inner", {})[name] = value
        elif writable:
            setattr(inner, name, value)
        else:
            raise AttributeError(f"`{name}` belongs to the inner optimizer; set it there.")

    return property(fget, fset, doc=f"The inner optimizer's ``{name}``.")


@keras.saving.register_keras_serializable(package="accum_optimizer")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate gradients over micro-batches, update once per window.

    Each call to :meth:`apply` / :meth:`apply_gradients` is one *micro-step*:
    the gradients are added into accumulator slots (one non-trainable
    variable per trainable variable, same shape and dtype). On every
    ``gradient_accumulation_steps``-th micro-step the inner optimizer is
    called once with the window's gradient (the mean, or the sum, of the
    accumulated micro-batch gradients) and the slots are zeroed. Between
    updates the model weights and all of the inner optimizer's state
    (slots, ``iterations``, EMA, learning-rate schedule position) are left
    bitwise untouched, so ``N`` micro-batches of ``B`` samples train exactly
    like one batch of ``N * B`` samples when the loss is a mean over the
    batch.

    Args:
        inner_optimizer: a ``keras.optimizers.Optimizer`` instance, or an
            identifier that ``keras.optimizers.get`` resolves (``"adam"``).
            Clipping, weight decay, EMA and learning-rate schedules are set
            on it; they act once per update, on the window's gradient, and
            schedules see update counts.
        gradient_accumulation_steps: ``int >= 1``, the number ``N`` of
            micro-steps per update. ``1`` is a pass-through to the inner
            optimizer (no accumulator slots are created). Or a schedule over
            updates: a dict ``{first_update: N, ...}`` (piecewise constant;
            int keys strictly ascending from 0, serializable with
            ``get_config``) or a callable ``update_index -> N`` (it gets the
            update index as an int64 scalar tensor and returns an int or an
            int scalar tensor >= 1; ``get_config`` needs it to be a
            registered Keras object). A window that starts at update ``u``
            has ``N(u)`` micro-steps (Lightning's
            ``GradientAccumulationScheduler``, optax's ``every_k_schedule``).
        reduction: ``"mean"`` (default) applies ``Σ cᵢ·gᵢ / Σ cᵢ`` over the
            window's micro-steps, ``cᵢ`` their ``weight`` (1 without one:
            ``sum / N``), equivalent to the large batch for a mean-reduced
            loss; ``"sum"`` applies ``Σ cᵢ·gᵢ``.
        nonfinite: what a micro-step whose gradients are not all finite (NaN
            or Inf in any variable's gradient) does to its window:

            * ``"propagate"`` (default): nothing special; the gradient is
              accumulated as it is, so the window's update carries the NaN or
              Inf to the weights, exactly as one large batch with that sample
              would. It is the plain large-batch semantics and costs nothing:
              no check, no extra reduction (under a strategy, still one
              cross-replica reduction per update). Under ``"mixed_float16"``
              the ``LossScaleOptimizer`` that ``compile`` puts outside already
              checks every micro-step and skips an overflowing one before it
              reaches this optimizer (what ``"skip_micro_step"`` does), so the
              common case of overflow is covered without a second check.
            * ``"skip_micro_step"``: the micro-batch is dropped and not
              counted (``micro_steps`` does not move, ``skipped_micro_steps``
              does); the window takes one more micro-batch. What a
              ``LossScaleOptimizer`` outside does, without loss scaling.
            * ``"skip_window"``: the micro-step counts towards its window but
              adds nothing, and the window's last micro-step discards the
              window instead of updating (accumulators zeroed, inner optimizer
              not called, ``iterations`` unchanged, ``skipped_windows += 1``),
              as a large batch containing that micro-batch would skip its
              step. With a ``LossScaleOptimizer`` outside (also the one
              ``compile`` adds under ``"mixed_float16"``), a micro-step that
              it skips never reaches this optimizer; the wrapper finds that
              ``LossScaleOptimizer`` when it is built (it is the caller of
              :meth:`build`) and hooks its non-finite branch, so such a
              micro-step is counted and discards its window in the same way.

            The skipping policies check finiteness once per micro-step (one
            reduction over all gradients, in the graph: no host sync) and,
            under a multi-replica strategy, all-reduce that one scalar so
            that every replica skips together. ``gradient_accumulation_steps=1``
            with a skipping policy keeps a window of one micro-step (and its
            accumulators) instead of the pass-through.
        accumulator_dtype: dtype of the accumulators. ``None`` (default):
            float32 for float16/bfloat16 variables (a 16-bit running sum
            stalls: in bfloat16, 256 + 1 = 256), the variable's own dtype
            otherwise. Or an explicit float dtype for every variable. Each
            gradient is cast to it when added; the window gradient is cast
            back to the variable's dtype once, after the division by N.
        name: optional name of the wrapper.

    State (all ``keras.Variable``s, saved wherever Keras saves optimizer
    state):
        ``micro_steps``: int64 scalar, micro-steps taken (units: micro-steps).
        ``iterations``: the inner optimizer's int64 counter, i.e. updates
            taken (units: updates), flushed ones included. After ``m``
            micro-steps with a constant N and no flush,
            ``iterations == m // N`` and ``micro_steps == m``.
        ``mini_step``: int64 scalar, micro-steps in the current window (its
            position; optax's ``mini_step``). The window closes when it
            reaches N; assign it to move the update step.
        ``window_weight``: float32 scalar, the current window's ``Σ cᵢ``
            (``ON_READ``, summed over replicas, like the accumulators).
        ``acc_grads``: accumulator slots, shape and dtype of each trainable
            variable. Under ``tf.distribute`` they are ``ON_READ`` variables
            (each replica keeps its local sum; reading them in cross-replica
            context, as saving does, gives the sum over replicas).
        ``grad_received``: int64 vector ``(num_trainable_variables,)``, 1
            where a variable has had a gradient in the current window.
        ``skipped_micro_steps``, ``skipped_windows`` (skipping policies only,
            ``None`` under ``"propagate"``): int64 scalars, non-finite
            micro-steps dropped (including those a ``LossScaleOptimizer``
            outside skipped) and windows discarded. ``iterations``,
            learning-rate schedules and EMA never count them. Under
            ``"skip_micro_step"`` ``micro_steps`` counts accepted micro-steps
            only; under ``"skip_window"`` it counts every micro-step, and
            ``iterations == micro_steps // N - skipped_windows``.
        ``window_poisoned`` (``"skip_window"`` only): int64 scalar, 1 while
            the current window has had a non-finite micro-step.
        ``touched_rows``: one row tracker per trainable variable of rank
            >= 1: float16 ``(shape[0],)``, > 0 at the rows that sparse
            gradients touched in the current window; 2 bytes per row of the
            first axis (an ``Embedding(V, D)`` table of float32: ``2 V``
            bytes next to its ``4 V D``-byte accumulator, 1/(2 D)).
            Replica-local (``ON_READ``) like the accumulators. Saved last;
            state saved without them (by earlier versions) restores with every row
            whose accumulator is non-zero marked.

    Missing gradients: a ``None`` gradient contributes nothing on that
    micro-step; a variable with no gradient in the whole window is not
    updated (neither its weight, its slots, nor its weight decay), as in
    large-batch training.

    Sparse gradients: ``tf.IndexedSlices`` (from ``Embedding``) are
    scatter-added into the slots, never densified per micro-step, and their
    rows are marked in the variable's tracker. When the window closes on a
    sparse gradient (or on none), the update costs O(rows touched) where the
    inner optimizer allows it: plain ``SGD`` (``momentum=0``) gets the window
    gradient as ``tf.IndexedSlices`` over the touched rows, each once (their
    sum, /N for ``"mean"``), and applies it as a scatter. Every other inner
    optimizer (``SGD`` with momentum, Adam, Adagrad, Ftrl, RMSprop, ...)
    would densify the slices itself, so it gets the dense window gradient,
    as before. Either way only the touched rows of the accumulator are
    zeroed afterwards. A variable whose gradient on the closing micro-step
    is dense (a tied embedding, used for the lookup and as the output
    projection, gets one dense gradient per micro-step) takes the dense path
    for that window.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras 3 optimizer, or
            ``gradient_accumulation_steps`` is not an int.
        ValueError: ``gradient_accumulation_steps < 1``; ``reduction`` not in
            ``("mean", "sum")``; the inner optimizer already accumulates;
            base-optimizer arguments (``clipnorm``, ``weight_decay``, ...) are
            passed to the wrapper instead of the inner optimizer.
    """

    # False: every window is dense, as before the row trackers (the trackers
    # still exist and are saved). Not API: benchmarks/sparse.py sets it to
    # measure the dense window next to the sparse one.
    _sparse_windows = True

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
        if keras.backend.backend() != "tensorflow":
            raise NotImplementedError(
                "AccumulatingOptimizer supports Keras 3 on the TensorFlow backend "
                f"for now; this Keras runs the {keras.backend.backend()!r} "
                "backend (KERAS_BACKEND). Use KERAS_BACKEND=tensorflow."
            )
        for arg, default in _INNER_ONLY_ARGS.items():
            if arg not in kwargs:
                continue
            value = kwargs.pop(arg)
            if value is not None and value != default:
                raise ValueError(
                    f"AccumulatingOptimizer does not take `{arg}` (received "
                    f"{arg}={value!r}). Set it on the inner optimizer, e.g. "
                    f"keras.optimizers.Adam({arg}=...), where it acts once "
                    "per update on the window's gradient."
                )
        acc_lib.check_arguments(
            inner_optimizer, gradient_accumulation_steps, kwargs,
            accepted=acc_lib.ARGUMENTS + acc_lib.NUMERICS_ARGUMENTS,
        )
        steps = acc_lib.validate_accumulation_schedule(gradient_accumulation_steps)
        reduction = acc_lib.validate_reduction(reduction)
        nonfinite = acc_lib.validate_nonfinite(nonfinite)
        accumulator_dtype = _validate_accumulator_dtype(accumulator_dtype)
        inner = _resolve_inner(inner_optimizer)
        if not isinstance(steps, int) or steps > 1 or nonfinite != "propagate":  # (the pass-through goes wherever its inner goes)
            _check_strategy()

        super().__init__(learning_rate=0.0, name=name)
        # The base class made its own `iterations` and `learning_rate`
        # variables; ours forward to the inner optimizer, so `variables`
        # (and so the saved state) leaves them out.
        self._unused_base_variables = (self._iterations, self._learning_rate)
        self.inner_optimizer = inner
        # Set after `super().__init__` so Keras' own accumulation stays off;
        # read-only from here on (see the property).
        object.__setattr__(self, "_gradient_accumulation_steps", steps)
        self.reduction = reduction
        self.nonfinite = nonfinite
        self.accumulator_dtype = accumulator_dtype
        self._deferred_state: dict[str, np.ndarray] | None = None
        # State of a LossScaleOptimizer outside, saved with this optimizer's
        # (see `save_own_variables`) and waiting for `build` to find it.
        self._deferred_outer_state: dict[str, np.ndarray] | None = None
        self.skipped_micro_steps = None
        self.skipped_windows = None
        self.window_poisoned = None
        # (Untracked attributes: Keras and TF track the variables by name.)
        object.__setattr__(self, "_nonfinite_variables", [])
        object.__setattr__(self, "_window_variables", [])
        object.__setattr__(self, "_window_length", acc_lib.window_length(steps))
        object.__setattr__(self, "_flush_function", None)
        self.mini_step = None
        self.window_weight = None
        # Row trackers (see `_add_row_tracker`) and, by build-order index, the
        # variables seen with a `tf.IndexedSlices` gradient in a traced step.
        self.touched_rows = []
        object.__setattr__(self, "_rows_by_index", [])
        object.__setattr__(self, "_tracker_variables", [])
        object.__setattr__(self, "_sparse_seen", set())
        object.__setattr__(self, "_outer_ref", None)
        # Like Keras' `iterations`, the micro-step counter exists before
        # `build`, so that restoring it (load_weights before the first step)
        # shows at once.
        with keras.name_scope(self.name, caller=self):
            # (Tracked by the attribute assignment, as Keras tracks variables.)
            self.micro_steps = keras.Variable(
                0, name="micro_steps", dtype="int", trainable=False, aggregation="only_first_replica"
            )

    @property
    def gradient_accumulation_steps(self) -> Any:
        """N, micro-steps per update: an int, or the schedule given (a dict
        ``{first_update: N}`` or a callable ``update_index -> N``). Read-only:
        fixed at construction."""
        return self.__dict__.get("_gradient_accumulation_steps")

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: Any) -> None:
        if "_gradient_accumulation_steps" not in self.__dict__:
            # Keras' base __init__ sets its own (None: built-in accumulation off).
            if value is None:
                return
        raise AttributeError(
            "`gradient_accumulation_steps` is read-only after construction "
            f"(it is {self.gradient_accumulation_steps}; received {value!r}): "
            "a traced train step has already fixed the window length, and "
            "changing it would drop or mis-scale the partial window. Create a "
            "new AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps=...) "
            "instead."
        )

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulator slots, counters and the inner's variables.

        Not run under ``no_automatic_dependency_tracking`` (unlike
        ``LossScaleOptimizer.build``), so that variables the inner optimizer
        creates as plain attributes (Nadam's ``_u_product``) stay tracked and
        saved.
        """
        if self.built:
            # LossScaleOptimizer.build builds its inner optimizer again even
            # when it is built (LossScaleOptimizer(built_wrapper)): keep the
            # state, only look for the new outer optimizer.
            self._attach_outer(_outer_loss_scale_optimizer(self))
            return
        var_list = list(var_list)
        if self._accumulates:
            _check_strategy()
        for v in var_list:
            if self._accumulates and self._overwrite_variable_with_gradient(v):
                raise ValueError(
                    "AccumulatingOptimizer does not support variables with "
                    f"`overwrite_with_gradient=True` (received {_path(v)!r}); "
                    "these carry float8 scaling state rather than gradients."
                )
        # What BaseOptimizer.build does, without Keras' own accumulation. The
        # model's variables must not be tracked as optimizer variables (the
        # base class builds under `no_automatic_dependency_tracking` for this).
        self._trainable_variables_indices = {
            self._var_key(v): i for i, v in enumerate(var_list)
        }
        object.__setattr__(self, "_trainable_variables", var_list[:])
        with keras.name_scope(self.name, caller=self):
            if self._accumulates:
                self.grad_received = self.add_variable(
                    shape=(len(var_list),),
                    dtype="int",
                    aggregation="only_first_replica",
                    name="grad_received",
                )
                self.acc_grads = [self._add_accumulator(v) for v in var_list]
                # Saved after everything else (see `variables`).
                trackers = [self._add_row_tracker(v) for v in var_list]
                object.__setattr__(self, "_rows_by_index", trackers)
                self.touched_rows = [t for t in trackers if t is not None]  # (tracked for checkpoints)
                object.__setattr__(self, "_tracker_variables", list(self.touched_rows))
            else:
                self.grad_received = None
                self.acc_grads = []
            if self.nonfinite != "propagate":
                # Saved after the inner optimizer's variables (see `variables`).
                counters = ["skipped_micro_steps", "skipped_windows"]
                if self.nonfinite == "skip_window":
                    counters.append("window_poisoned")
                created = []
                for counter in counters:
                    variable = self.add_variable(
                        shape=(), dtype="int", aggregation="only_first_replica", name=counter
                    )
                    setattr(self, counter, variable)
                    created.append(variable)
                object.__setattr__(self, "_nonfinite_variables", created)
            if self._accumulates:
                # The window's position and count (saved last: state saved
                # without them, by 0.1.0 and 0.2.0.dev0, is a prefix).
                self.mini_step = self.add_variable(
                    shape=(), dtype="int", aggregation="only_first_replica", name="mini_step"
                )
                self.window_weight = keras.Variable(
                    initializer=keras.initializers.Zeros(), shape=(), dtype="float32", trainable=False,
                    aggregation="sum", synchronization="on_read", name="window_weight",
                )
                self._track_variable(self.window_weight)
                object.__setattr__(self, "_window_variables", [self.mini_step, self.window_weight])
        self.inner_optimizer.build(var_list)
        self.built = True
        # `build` may run inside the first traced train step; restores must
        # happen now, not in a graph that tf.function may discard.
        if self._deferred_state is not None:
            state, self._deferred_state = self._deferred_state, None
            with _outside_functions():
                self.load_own_variables(state)
        self._attach_outer(_outer_loss_scale_optimizer(self))

    @property
    def _accumulates(self) -> bool:
        """Whether micro-steps go through windows (else: the pass-through)."""
        steps = self.gradient_accumulation_steps
        return not isinstance(steps, int) or steps > 1 or self.nonfinite != "propagate"

    def _accumulator_dtype(self, variable: Any) -> str:
        if self.accumulator_dtype is not None:
            return self.accumulator_dtype
        dtype = keras.backend.standardize_dtype(variable.dtype)
        return "float32" if dtype in ("float16", "bfloat16") else dtype

    # ------------------------------------------- a LossScaleOptimizer outside
    @property
    def outer_optimizer(self) -> Any:
        """The ``LossScaleOptimizer`` wrapped around this optimizer (found
        when it built this one), or ``None``."""
        ref = self.__dict__.get("_outer_ref")
        return None if ref is None else ref()

    def _attach_outer(self, outer: Any) -> None:
        """Remember the ``LossScaleOptimizer`` outside (weakly, and untracked:
        it is not this optimizer's state to save as a child), restore its
        state if it was saved with this optimizer's, and, for a skipping
        policy, hook the branch where it skips a non-finite micro-step.

        Keras' ``LossScaleOptimizer`` does not call the inner ``apply`` on a
        non-finite step: it only halves the scale (in
        ``_stateful_handle_non_finite_grads``, which both its single-device
        and its ``merge_call`` paths look up on the instance when they run).
        The hook calls the original, then records a skipped micro-step here
        (:meth:`_outer_skipped_micro_step`).
        """
        if outer is None:
            return
        object.__setattr__(self, "_outer_ref", weakref.ref(outer))
        if self._deferred_outer_state is not None:
            state, self._deferred_outer_state = self._deferred_outer_state, None
            with _outside_functions():
                self._load_outer_state(state)
        if self.nonfinite == "propagate":
            return
        original = getattr(outer, "_stateful_handle_non_finite_grads", None)
        if getattr(original, "_accumulating_optimizer", None) is self:
            return  # already hooked
        if not callable(original):
            raise NotImplementedError(
                f"nonfinite={self.nonfinite!r} with a {type(outer).__name__} outside "
                "needs to learn of the micro-steps it skips, through its "
                "`_stateful_handle_non_finite_grads` method, which this Keras "
                f"({keras.__version__}) does not have. Use nonfinite='propagate' "
                "(the LossScaleOptimizer then skips overflowing micro-steps by itself)."
            )
        wrapper = weakref.ref(self)

        def handle_non_finite_grads(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            accumulating = wrapper()
            if accumulating is not None:
                accumulating._outer_skipped_micro_step()
            return result

        handle_non_finite_grads._accumulating_optimizer = self
        object.__setattr__(outer, "_stateful_handle_non_finite_grads", handle_non_finite_grads)

    def _outer_skipped_micro_step(self) -> None:
        """Record a micro-step that the ``LossScaleOptimizer`` outside skipped:
        the same micro-step as a non-finite one seen here, with no gradients."""
        import tensorflow as tf

        grads = [None] * len(self._trainable_variables)
        if tf.distribute.in_cross_replica_context():
            self._cross_replica_step(tf.distribute.get_strategy(), grads, finite=False)
        else:
            self._micro_step(grads, finite=False)

    def _outer_own_variables(self) -> list:
        """The outer optimizer's own variables (its ``variables`` without
        this optimizer's), in its order."""
        outer = self.outer_optimizer
        if outer is None:
            return []
        variables = list(outer.variables)
        own = variables[: len(variables) - len(self.variables)]
        mine = {id(v) for v in self.variables}
        return [v for v in own if id(v) not in mine]

    def _load_outer_state(self, state: Mapping[str, Any]) -> None:
        variables = self._outer_own_variables()
        if len(variables) != len(state):
            raise ValueError(
                f"Cannot restore the state of {type(self.outer_optimizer).__name__} "
                f"'{self.outer_optimizer.name}' saved with optimizer '{self.name}': "
                f"it has {len(variables)} variables, the saved state has {len(state)}."
            )
        for i, variable in enumerate(variables):
            variable.assign(state[f"{_OUTER_KEY}{i}"])

    def _add_accumulator(self, reference: Any) -> Any:
        """One slot per trainable variable: a replica-local (``ON_READ``,
        summed on read) zero-initialised copy of its shape, in the
        accumulator dtype (:meth:`_accumulator_dtype`)."""
        name = f"{_path(reference).replace('/', '_').replace(':', '_')}_acc_grad"
        with self._colocate_with(reference):
            variable = keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=reference.shape,
                dtype=self._accumulator_dtype(reference),
                trainable=False,
                aggregation="sum",
                synchronization="on_read",
                name=name,
            )
        self._track_variable(variable)
        return variable

    def _add_row_tracker(self, reference: Any) -> Any:
        """A row tracker for a variable of rank >= 1 (else ``None``): a
        replica-local (``ON_READ``, summed on read) float16 vector of shape
        ``(reference.shape[0],)``, > 0 at the rows that sparse gradients
        touched in the current window (2 bytes per row of the first axis).

        float16, as in the legacy family: restoring a summed ``ON_READ``
        variable divides the saved sum by the replica count, which turns an
        integer mark of 1 into 0 but a float16 one into 0.5 (still a mark).
        """
        if len(reference.shape) < 1:
            return None
        name = f"{_path(reference).replace('/', '_').replace(':', '_')}_touched_rows"
        with self._colocate_with(reference):
            variable = keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=tuple(reference.shape[:1]),
                dtype="float16",
                trainable=False,
                autocast=False,
                aggregation="sum",
                synchronization="on_read",
                name=name,
            )
        self._track_variable(variable)
        return variable

    def _colocate_with(self, reference: Any):
        strategy = getattr(self, "_distribution_strategy", None)
        if strategy is None:
            return contextlib.nullcontext()
        if isinstance(reference, keras.Variable):
            reference = reference.value
        return strategy.extended.colocate_vars_with(reference)

    @property
    def variables(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        ``acc_grads``), all of the inner optimizer's, then those of the
        skipping policies (``skipped_micro_steps``, ``skipped_windows``,
        ``window_poisoned``), then the window's ``mini_step`` and
        ``window_weight``, then the row trackers (``touched_rows``, one per
        variable of rank >= 1): last, so that state saved without them (by
        ``"propagate"``, by 0.1.0, by versions before the window position or
        the trackers) is a prefix of the state saved with them (see
        :meth:`_saved_layout`)."""
        left_out = (list(self._unused_base_variables) + self._nonfinite_variables + self._window_variables
                    + self._tracker_variables)
        own = [v for v in self._variables if not any(v is u for u in left_out)]
        return (own + self.inner_optimizer.variables + self._nonfinite_variables + self._window_variables
                + self._tracker_variables)

    def __dir__(self):
        # Keras' saving walks `dir()` for child objects to save. The inner
        # optimizer's variables are already in this optimizer's `variables`
        # (saved and restored together, deferred until build if need be), so
        # hide it there: otherwise its state is written twice and, on an
        # unbuilt optimizer, Keras warns that it skipped it.
        # `outer_optimizer` (the LossScaleOptimizer around this one) is the
        # parent, not a child: walking it would recurse without end.
        return [a for a in super().__dir__() if a not in ("inner_optimizer", "outer_optimizer")]

    @property
    def iterations(self) -> Any:
        """Updates taken: the inner optimizer's int64 ``iterations``."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (getter and setter)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    # What Keras' own code reads (or writes) on whatever optimizer it is given,
    # unwrapping `inner_optimizer` at most once (LossScaleOptimizer, the
    # callbacks): answered by the inner optimizer, which owns them.
    # LossScaleOptimizer: `inner_optimizer.loss_scale_factor = None`;
    # SwapEMAWeights: `use_ema`, `_model_variables_moving_average`;
    # LearningRateScheduler, ReduceLROnPlateau, TensorBoard: `optimizers`
    # (MultiOptimizer), `learning_rate`; `iterations` above.
    use_ema = _forwarded("use_ema")
    ema_momentum = _forwarded("ema_momentum")
    ema_overwrite_frequency = _forwarded("ema_overwrite_frequency")
    loss_scale_factor = _forwarded("loss_scale_factor")
    clipnorm = _forwarded("clipnorm")
    global_clipnorm = _forwarded("global_clipnorm")
    clipvalue = _forwarded("clipvalue")
    weight_decay = _forwarded("weight_decay")
    _model_variables_moving_average = _forwarded("_model_variables_moving_average", writable=False)
    optimizers = _forwarded("optimizers", writable=False)

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Forwarded to the inner optimizer, which owns the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`variables`).

        Raises:
            ValueError: the optimizer is not built, or the number or shapes of
                ``weights`` do not match :attr:`variables`.
        """
        if not self.built:
            raise ValueError(
                "set_weights() needs a built optimizer; call "
                "`optimizer.build(trainable_variables)` first."
            )
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must have one array per optimizer variable: expected "
                f"{len(variables)}, received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"Optimizer variable {_path(variable)!r} has shape "
                    f"{tuple(variable.shape)}; received a weight of shape "
                    f"{tuple(np.shape(weight))}."
                )
            variable.assign(weight)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def save_own_variables(self, store: Any) -> None:
        """Save :attr:`variables` (keys ``"0"``, ``"1"``, ...) and, with a
        ``LossScaleOptimizer`` outside, its own variables (loss scale and
        growth counter) under ``"outer_optimizer.0"``, ...

        Keras restores a ``LossScaleOptimizer``'s state only when it is
        already built; loading weights into a fresh model skips it with a
        warning ("Skipping variable loading for optimizer
        'loss_scale_optimizer'"), and the loss scale would restart from its
        initial value. Saved here, it is restored with this optimizer's state
        when the ``LossScaleOptimizer`` builds (see :meth:`build`).
        """
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable.numpy()
        for i, variable in enumerate(self._outer_own_variables()):
            store[f"{_OUTER_KEY}{i}"] = variable.numpy()

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`save_own_variables`.

        On an optimizer that is not built yet the values are kept and
        restored by :meth:`build` (Keras itself would skip them with a
        warning). An empty store (weights saved without optimizer state)
        restores nothing. State saved without the variables of the skipping
        policies (with ``nonfinite="propagate"``, or by 0.1.0) loads into an
        optimizer with a skipping policy: the counters start at 0. The state
        of a ``LossScaleOptimizer`` outside, if saved, is restored into the
        ``LossScaleOptimizer`` this optimizer is built by.

        Raises:
            ValueError: if the number of saved variables does not match.
        """
        keys = list(store.keys())
        own_keys = [k for k in keys if not k.startswith(_OUTER_KEY)]
        outer_keys = [k for k in keys if k.startswith(_OUTER_KEY)]
        if not own_keys:
            return  # weights saved without optimizer state: nothing to restore
        if not self.built:
            self._deferred_state = {k: np.asarray(store[k]) for k in keys}
            self._restore_counters(self._deferred_state)
            return
        variables = self._saved_layout(store, len(own_keys))
        if len(own_keys) != len(variables):
            raise ValueError(
                f"Cannot restore optimizer '{self.name}': it has "
                f"{len(variables)} variables but the saved state has "
                f"{len(own_keys)}. Was it saved with a different inner "
                "optimizer, gradient_accumulation_steps, nonfinite policy or "
                "model? To load only the model's weights, use "
                "keras.saving.load_weights(model, path, "
                "objects_to_skip=[model.optimizer]) on a .weights.h5 file."
            )
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])
        if self._window_variables and not any(v is self.mini_step for v in variables):
            # Saved before the window had its own position (0.2.0.dev0 and
            # older, no flush, no schedule): it was `micro_steps % N`.
            steps = self.gradient_accumulation_steps
            position = int(self.micro_steps.numpy()) % steps if isinstance(steps, int) else 0
            self.mini_step.assign(position)
            self.window_weight.assign(float(position))
        if self._tracker_variables and not any(variables[-1] is t for t in self._tracker_variables):
            self._mark_rows_of_restored_accumulators()
        if outer_keys:
            outer_state = {k: np.asarray(store[k]) for k in outer_keys}
            if self.outer_optimizer is not None:
                self._load_outer_state(outer_state)
            else:
                self._deferred_outer_state = outer_state

    def _saved_layout(self, store: Mapping[str, Any], saved: int) -> list:
        """The variables that ``saved`` stored arrays fill, in order:
        :attr:`variables`, or the layouts of older or other-policy saves,
        which lack some of its three optional trailing blocks (the skipping
        counters, saved with ``"propagate"``; the window's
        ``mini_step``/``window_weight``, 0.2.0.dev0 and older; the row
        trackers, before them). Of the layouts of the right length, the first
        whose variables match the stored arrays in shape and in dtype kind
        (the counters are int scalars, ``window_weight`` a float scalar, the
        trackers float vectors); :attr:`variables` when none fits (the caller
        raises)."""
        import itertools

        blocks = [self._nonfinite_variables, self._window_variables, self._tracker_variables]
        base = self.variables[: len(self.variables) - sum(len(b) for b in blocks)]
        layouts = []
        for keep in itertools.product((True, False), repeat=len(blocks)):
            layout = base + [v for k, b in zip(keep, blocks) if k for v in b]
            if len(layout) == saved:
                layouts.append(layout)

        def fits(layout: list) -> bool:
            for i, v in enumerate(layout):
                value = np.asarray(store[str(i)])
                if tuple(v.shape) != value.shape:
                    return False
                if keras.backend.is_float_dtype(v.dtype) != np.issubdtype(value.dtype, np.floating):
                    return False
            return True

        fitting = [layout for layout in layouts if fits(layout)]
        return fitting[0] if fitting else self.variables

    def _mark_rows_of_restored_accumulators(self) -> None:
        """State saved without row trackers (by a version before them): mark
        every row whose restored accumulator is non-zero, so that the window
        in progress loses nothing when it closes. (A row whose sum is exactly
        zero adds nothing to a window anyway.)"""
        for acc, tracker in zip(self.acc_grads, self._rows_by_index):
            if tracker is None:
                continue
            value = np.asarray(acc.numpy())
            touched = np.any(value.reshape(value.shape[0], -1) != 0, axis=1)
            tracker.assign(touched.astype("float16"))

    def _restore_counters(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore, before build, the two counters that already exist:
        ``micro_steps`` and the inner ``iterations`` (what resume idioms read
        to compute ``initial_epoch``). The rest waits for :meth:`build`,
        which checks that the whole state fits.

        The saved order is :attr:`variables`: ``micro_steps``, then (N > 1,
        or a skipping ``nonfinite`` policy) ``grad_received`` of shape
        ``(n,)`` and ``n`` accumulators, then the inner optimizer's variables,
        ``iterations`` first (then the skip counters).
        """
        inner_vars = self.inner_optimizer.variables
        if not inner_vars or inner_vars[0] is not self.inner_optimizer.iterations:
            return
        own = 1
        if self._accumulates:
            received = state.get("1")
            if received is None or received.ndim != 1:
                return
            own = 2 + received.shape[0]
        for key, variable in (("0", self.micro_steps), (str(own), self.inner_optimizer.iterations)):
            value = state.get(key)
            if value is None or value.shape != () or not np.issubdtype(value.dtype, np.integer):
                return
        self.micro_steps.assign(state["0"])
        self.inner_optimizer.iterations.assign(state[str(own)])

    # ------------------------------------------------------------ micro-step
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None) -> Any:
        """:meth:`apply` with ``(gradient, variable)`` pairs; returns
        ``iterations`` (updates taken)."""
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None, weight: Any = None) -> None:
        """Take one micro-step with ``grads`` for ``trainable_variables``.

        ``grads[i]`` is the gradient of the micro-batch loss for
        ``trainable_variables[i]`` (a dense tensor of the variable's shape, a
        ``tf.IndexedSlices``, or ``None``). Without ``trainable_variables``
        the gradients must match the variables the optimizer was built with.

        ``weight``: the micro-batch's count ``c``, what its mean loss was
        taken over (samples, sum of sample weights, unmasked tokens): a
        Python number or a scalar tensor >= 0, finite; it may differ per
        micro-step. The window applies ``Σ cᵢ·gᵢ / Σ cᵢ`` (``"mean"``) or
        ``Σ cᵢ·gᵢ`` (``"sum"``); a window whose counts sum to 0 applies
        nothing (the inner optimizer is not called). ``None`` (default):
        the count reported by a :class:`accum_optimizer.CountedLoss` in this
        train step, if any, else 1 (every micro-step counts the same, the
        unweighted window). Under ``tf.distribute`` each replica passes its
        own count; each replica's gradient is its mean loss's divided by the
        replica count, as ``fit`` forms it.

        Raises:
            ValueError: lengths differ; a gradient's shape differs from its
                variable's; every gradient is ``None``; a variable is unknown;
                ``weight`` is not a scalar, is negative or not finite (inside
                ``tf.function``: ``InvalidArgumentError`` when the step runs,
                before any state changes).
            TypeError: ``weight`` is not a number.
        """
        import tensorflow as tf

        from accum_optimizer import counting

        if weight is None:
            weight = counting.reported_count(self.reduction)
        weight = acc_lib.check_weight(weight)
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "AccumulatingOptimizer.apply(grads) without "
                    "`trainable_variables` needs a built optimizer; call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length. "
                f"Received {len(grads)} gradients for "
                f"{len(trainable_variables)} variables."
            )
        if not grads:
            return
        grads = [
            g if g is None or _is_tensor_like(g) else ops.convert_to_tensor(g, dtype=v.dtype)
            for g, v in zip(grads, trainable_variables)
        ]
        acc_lib.validate_gradient_shapes(grads, trainable_variables, _path)
        if all(g is None for g in grads):
            names = [_path(v) for v in trainable_variables]
            raise ValueError(f"No gradients provided for any variable: {names}.")
        if any(g is None for g in grads):
            # Keras' own warning, word for word (once per trace, as plain Keras).
            self._filter_empty_gradients(grads, trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._check_variables_are_known(trainable_variables)

        if not self._accumulates:
            # Pass-through; its writes, too, wait for the gradients (see
            # `_accumulation`: a phantom call at the end of an input of
            # unknown length must not count).
            with tf.control_dependencies(acc_lib.gradient_tensors(grads + [weight])):
                if weight is None:
                    self.inner_optimizer.apply(grads, trainable_variables)
                else:
                    # A window of one micro-step: c·g/c = g ("mean") or c·g
                    # ("sum"); a count of 0 applies nothing.
                    if self.reduction == "sum":
                        grads = [acc_lib.scaled(g, weight) if g is not None else None for g in grads]
                    ops.cond(weight > 0, lambda: _none(self.inner_optimizer.apply(grads, trainable_variables)),
                             lambda: None)
                self.assign_add(self.micro_steps, 1)
            return
        # Put the gradients in build order; variables absent from this call
        # get None (no contribution this micro-step).
        full = [None] * len(self._trainable_variables)
        for g, v in zip(grads, trainable_variables):
            full[self._get_variable_index(v)] = g
        self._tf_apply(full, weight)

    def _tf_apply(self, grads: list, weight: Any = None) -> None:
        """TensorFlow path: the only place that knows about ``tf.distribute``
        (with :func:`_check_strategy`, which refuses the strategies it cannot
        serve).

        Under any strategy the ``cond`` that picks update steps runs in
        cross-replica context, inside one ``merge_call`` (as
        ``LossScaleOptimizer._tf_apply`` does): each replica adds its local
        gradients into its local (``ON_READ``) slots; the counters move once;
        and on update steps each replica hands its local window gradient to
        the inner optimizer, whose usual all-reduce is the one cross-replica
        reduction of the window. A replica-context ``cond`` cannot hold the
        update: the inner optimizer's ``iterations`` (and this wrapper's
        ``grad_received``) are ``ONLY_FIRST_REPLICA`` variables, and every
        update of those in replica context is a ``merge_call``
        (``values.apply_aggregation_replica_context``), which fails inside a
        ``cond`` -- the crash of Keras' built-in accumulation. That holds for
        strategies that otherwise need no ``merge_call`` (``MirroredStrategy``
        and ``MultiWorkerMirroredStrategy`` under XLA on GPUs,
        ``strategy_supports_no_merge_call()``) too, so they take the same
        path; their inner optimizer then all-reduces with collectives in
        replica context, once per update. ``MultiWorkerMirroredStrategy`` on
        CPUs, or on GPUs without XLA, needs ``merge_call`` anyway.
        """
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.apply() must be called in a replica "
                "context (e.g. inside strategy.run), not cross-replica context."
            )
        # Shapes unknown at trace time are checked when the step runs, before
        # any state changes: the check gates every write of this micro-step.
        checked = [
            g
            if g is None or isinstance(g, tf.IndexedSlices) or g.shape.is_fully_defined()
            else tf.ensure_shape(g, v.shape, name=f"gradient_shape_of_{_op_name(_path(v))}")
            for g, v in zip(grads, self._trainable_variables)
        ]
        if not tf.distribute.has_strategy():
            self._micro_step(checked, weight=weight)
            return
        tf.distribute.get_replica_context().merge_call(
            self._cross_replica_step, args=(checked,), kwargs={"weight": weight}
        )

    def _cross_replica_step(self, distribution: Any, grads: list, finite: Any = None, weight: Any = None) -> None:
        # Runs once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        import tensorflow as tf

        def each_replica(fn, *args):
            return distribution.extended.call_for_each_replica(fn, args=args)

        def all_replicas(flag):
            # The skipping policies' one scalar all-reduce per micro-step.
            bad = distribution.reduce(tf.distribute.ReduceOp.SUM, each_replica(_nonfinite_count, flag), axis=None)
            return tf.equal(bad, 0.0)

        self._micro_step(grads, each_replica, all_replicas, finite, weight)

    def _window_state(self) -> acc_lib.WindowState:
        # Row trackers are handed to the algorithm only for variables that
        # have had a `tf.IndexedSlices` gradient in some traced step
        # (`_accumulation.sparse_window` gives a tracked variable without a
        # gradient on the closing micro-step a sparse window, which a dense
        # variable must not get); `_sparse_windows` off: none (every window dense).
        rows = [t if i in self._sparse_seen else None for i, t in enumerate(self._rows_by_index)]
        return acc_lib.WindowState(
            self.acc_grads,
            self.micro_steps,
            self.grad_received,
            touched_rows=rows if self._sparse_windows and rows else None,
            skipped_micro_steps=self.skipped_micro_steps,
            skipped_windows=self.skipped_windows,
            window_poisoned=self.window_poisoned,
            variable_dtypes=[v.dtype for v in self._trainable_variables],
            mini_step=self.mini_step,
            window_weight=self.window_weight,
            updates=self.inner_optimizer.iterations,
            sparse_update=[_keeps_slices_sparse(self.inner_optimizer)] * len(self._trainable_variables),
        )

    def _micro_step(
        self, grads: list, each_replica: Any = None, all_replicas: Any = None, finite: Any = None, weight: Any = None
    ) -> None:
        import tensorflow as tf

        for i, g in enumerate(grads):  # remembered across traces (see `_window_state`)
            if isinstance(acc_lib._local(g), tf.IndexedSlices) and self._rows_by_index[i] is not None:
                self._sparse_seen.add(i)
        replicas = _replicas_in_sync()
        acc_lib.micro_step(
            _KerasBackend(self),
            self._window_state(),
            grads,
            self._apply_inner,
            self._window_length,
            self.reduction,
            each_replica,
            nonfinite=self.nonfinite,
            all_replicas=all_replicas,
            finite=finite,
            weight=weight,
            replicas=replicas,
            weighted=self._weighted(weight, replicas),
        )

    def _weighted(self, weight: Any, replicas: int) -> bool:
        """Trace-time: may this window's counts differ between replicas?
        Once any micro-step is traced with a weight, every window closed
        afterwards sums the counts over replicas (one scalar reduction per
        update); before, each replica divides by its own micro-step count,
        with no reduction. A traced close of the second kind that later
        meets weighted micro-steps would divide wrongly under a
        multi-replica strategy, so that order raises."""
        if weight is not None and not self.__dict__.get("_weights_seen"):
            if replicas > 1 and self.__dict__.get("_unweighted_close_traced"):
                raise ValueError(
                    "AccumulatingOptimizer got a weighted micro-step (weight= or a "
                    "CountedLoss) after a train step without weights was traced "
                    f"under a {replicas}-replica strategy; that step's update would "
                    "normalise by the micro-step count. Use weights in every train "
                    "step of this optimizer (weight=1 counts like none)."
                )
            object.__setattr__(self, "_weights_seen", True)
        weighted = bool(self.__dict__.get("_weights_seen"))
        if not weighted:
            object.__setattr__(self, "_unweighted_close_traced", True)
        return weighted

    # --------------------------------------------------------- partial window
    def flush(self) -> None:
        """Apply the current, partial window now as one update, if it holds
        at least one micro-step; a no-op on an empty window.

        The update is normalised by what the window holds (``"mean"``: its
        micro-steps, or the sum of their counts when weighted; never by N),
        exactly what a large batch of the window's samples would apply; then
        a new window starts. ``iterations`` moves by one, ``micro_steps``
        does not, and ``mini_step`` (the window's position) restarts at 0.
        Works eagerly and inside ``tf.function``, with or without a
        ``tf.distribute`` strategy (call it where you would call ``fit``, in
        cross-replica context). Lightning's forced step at epoch end divides
        by N instead (Lightning#19987); this one does not.
        ``accum_optimizer.FlushPartialWindow`` calls it at every epoch end.

        A window that a skipping policy marked non-finite is discarded, as
        its closing micro-step would; a window whose counts sum to 0 applies
        nothing.
        """
        if not self.built or not self._accumulates:
            return
        import tensorflow as tf

        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.flush() must be called in cross-replica "
                "context (outside strategy.run), like model.fit."
            )
        function = self.__dict__.get("_flush_function")
        if function is None:
            # (A function per optimizer: tf.function's retracing warning
            # would count one shared bound method across instances.)
            function = tf.function(lambda: self._flush_step(), autograph=False)
            object.__setattr__(self, "_flush_function", function)
        # The strategy the optimizer was built under (callbacks run outside
        # its scope).
        strategy = getattr(self, "_distribution_strategy", None)
        with strategy.scope() if strategy is not None and not tf.distribute.has_strategy() else contextlib.nullcontext():
            function()

    def _flush_step(self) -> None:
        import tensorflow as tf

        if not tf.distribute.has_strategy():
            self._flush_window()
            return
        strategy = tf.distribute.get_strategy()
        strategy.run(lambda: tf.distribute.get_replica_context().merge_call(lambda d: self._flush_window(d)))

    def _flush_window(self, distribution: Any = None) -> None:
        each_replica = None
        if distribution is not None:
            def each_replica(fn, *args):
                return distribution.extended.call_for_each_replica(fn, args=args)

        acc_lib.flush(
            _KerasBackend(self),
            self._window_state(),
            self._apply_inner,
            self.reduction,
            each_replica,
            nonfinite=self.nonfinite,
            replicas=_replicas_in_sync(),
            weighted=bool(self.__dict__.get("_weights_seen")),
        )

    def _apply_inner(self, window_grads: list, gates: dict) -> None:
        with self._gate_inner_updates(gates):
            self.inner_optimizer.apply(window_grads, self._trainable_variables)
        # The inner optimizer scatter-updated the variables of sparse windows:
        # keep their next reads (the forward passes) from copying them.
        for g, v in zip(window_grads, self._trainable_variables):
            if _is_slices(g):
                _disable_copy_on_read(v)

    @contextlib.contextmanager
    def _gate_inner_updates(self, gates: dict):
        """Skip, per variable, the inner update of variables that had no
        gradient in the window.

        ``gates`` (from :func:`_accumulation.micro_step`) holds, for each
        variable without a gradient on this micro-step, a boolean that is true
        iff it had one earlier in the window. For those variables the three
        inner-optimizer mutations (``update_step``, weight decay, the
        variable's constraint) run under an ``ops.cond`` on it, in the inner
        optimizer and in any optimizers it delegates to
        (``MultiOptimizer.optimizers``). Global state (``iterations``, EMA over
        all variables, Nadam's momentum product) moves once per update, as in
        the large-batch reference.

        Under ``MirroredStrategy`` every replica runs this at once (in its
        own thread) around the same inner optimizer, whose per-variable
        updates then run once, in the ``merge_call``: the first replica to
        enter installs the gates, the last to leave removes them (the gates
        are equal in every replica, ``grad_received`` being replicated).
        """
        if not gates:
            yield
            return
        gates = {self._var_key(self._trainable_variables[i]): g for i, g in gates.items()}
        with _GATE_LOCK:
            entered = self.__dict__.get("_gate_depth", 0)
            if entered == 0:
                object.__setattr__(self, "_remove_gates", self._install_gates(gates))
            object.__setattr__(self, "_gate_depth", entered + 1)
        try:
            yield
        finally:
            with _GATE_LOCK:
                object.__setattr__(self, "_gate_depth", self._gate_depth - 1)
                if self._gate_depth == 0:
                    remove = self._remove_gates
                    object.__setattr__(self, "_remove_gates", None)
                    remove()

    def _install_gates(self, gates: dict) -> Any:
        """Patch the gated mutations in; return the function that undoes it."""
        patched = []
        for opt in _optimizer_tree(self.inner_optimizer):
            patched.append(opt)
            object.__setattr__(opt, "update_step", _gated_update_step(opt, gates))
            object.__setattr__(opt, "_apply_weight_decay", _gated_weight_decay(opt, gates))
        constrained = []
        for v in self._trainable_variables:
            gate = gates.get(self._var_key(v))
            if gate is not None and getattr(v, "constraint", None) is not None:
                c = v.constraint
                constrained.append((v, c))
                v.constraint = lambda x, gate=gate, c=c: ops.cond(gate, lambda: c(x), lambda: x)

        def remove() -> None:
            for opt in patched:
                object.__delattr__(opt, "update_step")
                object.__delattr__(opt, "_apply_weight_decay")
            for v, c in constrained:
                v.constraint = c

        return remove

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "gradient_accumulation_steps": _serialize_schedule(self.gradient_accumulation_steps),
            "reduction": self.reduction,
            "nonfinite": self.nonfinite,
            "accumulator_dtype": self.accumulator_dtype,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "AccumulatingOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        steps = config.get("gradient_accumulation_steps")
        if isinstance(steps, dict) and "class_name" in steps:
            config["gradient_accumulation_steps"] = keras.saving.deserialize_keras_object(
                steps, custom_objects=custom_objects
            )
        return cls(inner, **config)


def _keeps_slices_sparse(inner: Any) -> bool:
    """Does ``inner`` apply a ``tf.IndexedSlices`` gradient as a sparse update
    (cost O(rows)), so that a sparse window should reach it as
    ``tf.IndexedSlices`` over the touched rows (a trace-time decision)?

    True only for ``keras.optimizers.SGD`` (or a subclass that keeps its
    ``update_step``) with ``momentum == 0``: its update is
    ``assign_sub(variable, gradient * lr)``, a ``scatter_sub`` for slices
    (``keras/src/optimizers/sgd.py``; ``assign_sub`` in
    ``keras/src/backend/tensorflow/optimizer.py``). With momentum, SGD
    computes ``m * momentum - gradient * lr``, which densifies the slices
    (``keras/src/backend/tensorflow/sparse.py``,
    ``elementwise_binary_union``); Adam, Adamax, Nadam, AdamW, Ftrl, Lion,
    RMSprop with momentum do the same. For those, handing slices would only
    add a gather, a densification (with TF's "Converting sparse
    IndexedSlices to a dense Tensor" warning on large tables) and, with
    repeated ids, a different result: they get the dense window gradient,
    and only the touched rows are zeroed afterwards.
    """
    return type(inner).update_step is keras.optimizers.SGD.update_step and float(inner.momentum) == 0.0


def _check_strategy() -> None:
    """Refuse the ``tf.distribute`` strategies that cannot accumulate
    (``ValueError``), at construction and at build under their scope (when
    the wrapper accumulates; the pass-through goes wherever its inner
    optimizer goes).

    Accumulation needs synchronous replicas that each own a replica-local
    (``ON_READ``) accumulator. Strategies of the parameter-server family
    hold every variable once, on parameter servers or the CPU, and let all
    replicas update it: the accumulator is shared, each replica adds its
    part, and the inner optimizer's all-reduce then counts every gradient
    once per replica (measured under ``CentralStorageStrategy`` with 2
    replicas: exactly the update of twice the learning rate, no error).
    ``ParameterServerStrategy`` workers also step asynchronously, so N
    micro-steps of one worker are no window of the global batch.
    """
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    refused = [
        ("ParameterServerStrategy",
         (tf.distribute.experimental.ParameterServerStrategy,
          tf.compat.v1.distribute.experimental.ParameterServerStrategy),
         "its workers step asynchronously, each at its own pace, so N "
         "micro-steps of one worker are not a window of the global batch; and "
         "the accumulators would live once on the parameter servers, shared "
         "by every worker"),
        ("CentralStorageStrategy",
         (tf.distribute.experimental.CentralStorageStrategy,
          tf.compat.v1.distribute.experimental.CentralStorageStrategy),
         "it keeps one copy of every variable, shared by all replicas, so the "
         "accumulators cannot be replica-local: every replica would add into "
         "the same slot and the inner optimizer's all-reduce would count each "
         "gradient once per replica (a silently wrong update)"),
    ]
    for name, classes, why in refused:
        if isinstance(strategy, classes):
            raise ValueError(
                f"AccumulatingOptimizer does not support {name} (the "
                f"tf.distribute strategy in scope is {type(strategy).__name__}): "
                f"{why}. Use tf.distribute.MirroredStrategy on one host or "
                "tf.distribute.MultiWorkerMirroredStrategy across hosts: "
                "synchronous replicas, replica-local accumulators, one "
                "all-reduce per update."
            )


class _KerasBackend:
    """:class:`_accumulation.Backend` for Keras 3 on TensorFlow: the
    optimizer's own ``assign``/``assign_add`` (``IndexedSlices`` become
    scatter ops) and ``keras.ops.cond``."""

    def __init__(self, optimizer: keras.optimizers.Optimizer) -> None:
        self._opt = optimizer

    def assign(self, variable: Any, value: Any) -> None:
        self._opt.assign(variable, value)

    def assign_add(self, variable: Any, value: Any) -> None:
        target = _replica_local(variable, value)
        self._opt.assign_add(target, value)
        if _is_slices(value):
            _disable_copy_on_read(target)

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> None:
        import tensorflow as tf

        value = tf.IndexedSlices(updates, indices)
        target = _replica_local(variable, value)
        self._opt.assign(target, value)
        _disable_copy_on_read(target)

    def cond(self, pred: Any, true_fn: Any, false_fn: Any) -> None:
        ops.cond(pred, lambda: _none(true_fn()), lambda: _none(false_fn()))


def _replica_local(variable: Any, value: Any) -> Any:
    """This replica's own component of a replica-local (``ON_READ``)
    accumulator, for scatter ops, which ``SyncOnReadVariable`` does not
    support (``NotImplementedError``) although its components do. Dense
    values and other variables pass through."""
    import tensorflow as tf

    if not isinstance(value, tf.IndexedSlices):
        return variable
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(inner, tf.distribute.DistributedValues) and tf.distribute.in_cross_replica_context() is False:
        # tensorflow/python/distribute/values.py: the replica's component.
        return inner._get_on_device_or_primary()
    return variable


def _none(_: Any) -> None:
    return None


def _serialize_schedule(steps: Any) -> Any:
    """``gradient_accumulation_steps`` for ``get_config`` (Keras 3's
    registry); see :func:`_keras2_common.serialize_schedule`.

    Raises:
        ValueError: an unregistered callable.
    """
    from accum_optimizer.families import _keras2_common

    return _keras2_common.serialize_schedule(keras, steps)


def _replicas_in_sync() -> int:
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def _in_xla_context() -> bool:
    """Is the graph being traced compiled by XLA (``jit_compile=True``)? XLA
    has no kernel for ``DisableCopyOnRead`` (and keeps its own buffers)."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # private module moved: assume XLA, skip the op
        return True
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _is_slices(value: Any) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.IndexedSlices)


def _disable_copy_on_read(variable: Any) -> None:
    """Switch a variable that a scatter op just wrote back to TensorFlow's
    normal access mode (``tf.raw_ops.DisableCopyOnRead``).

    A scatter op puts a resource variable in *copy-on-read* mode
    (``EnsureSparseVariableAccess`` in
    ``tensorflow/core/kernels/resource_variable_ops.h``), and from then on
    every dense read (``ReadVariableOp``) copies the whole buffer. For an
    embedding table that the sparse window scatter-updates, that is every
    forward pass (Keras' ``Embedding`` reads the table densely, then
    gathers): a table-sized copy per micro-step, 30 ms at 10^6 x 64 on 2 CPU
    cores, the cost of a dense update. Back in normal mode a dense read
    aliases the buffer, and the next scatter copies it only if such a read
    is still alive (TensorFlow's own check), so this is always safe; it only
    costs taking the variable's lock. A no-op where the op does not exist,
    under XLA, or where the variable has no handle (cross-replica context).
    """
    import tensorflow as tf

    op = getattr(tf.raw_ops, "DisableCopyOnRead", None)
    if op is None or _in_xla_context():
        return
    if isinstance(variable, keras.Variable):
        variable = variable.value
    try:
        handle = variable.handle
    except (AttributeError, ValueError):
        return
    op(resource=handle)


# Key prefix, in this optimizer's saved store, of the variables of a
# LossScaleOptimizer outside (see `save_own_variables`).
_OUTER_KEY = "outer_optimizer."


def _outer_loss_scale_optimizer(wrapper: Any) -> Any:
    """The ``keras.optimizers.LossScaleOptimizer`` whose ``inner_optimizer``
    is ``wrapper``, if one is building it, else ``None``.

    ``LossScaleOptimizer.build`` calls ``inner_optimizer.build``; Keras'
    ``compile`` under ``"mixed_float16"`` creates its ``LossScaleOptimizer``
    without telling the inner optimizer, so the only place the inner
    optimizer meets it is this call: the ``LossScaleOptimizer`` is the
    ``self`` of a frame up the stack. Looked up once per build.
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if (
            candidate is not wrapper
            and isinstance(candidate, keras.optimizers.LossScaleOptimizer)
            and getattr(candidate, "inner_optimizer", None) is wrapper
        ):
            return candidate
        frame = frame.f_back
    return None


def _nonfinite_count(flag: Any) -> Any:
    """1.0 where the finiteness flag is false (summed over replicas)."""
    import tensorflow as tf

    return tf.cast(tf.logical_not(flag), tf.float32)


def _validate_accumulator_dtype(value: Any) -> str | None:
    if value is None:
        return None
    try:
        dtype = keras.backend.standardize_dtype(value)
    except (ValueError, TypeError):
        dtype = None
    if dtype is None or not keras.backend.is_float_dtype(dtype):
        raise ValueError(
            "`accumulator_dtype` must be None (float32 for float16/bfloat16 "
            "variables, the variable's dtype otherwise) or a float dtype such "
            f"as 'float32'. Received: accumulator_dtype={value!r}."
        )
    return dtype


def _optimizer_tree(opt: Any) -> list:
    """``opt`` and the optimizers it delegates updates to (``MultiOptimizer``)."""
    found = [opt]
    for sub in getattr(opt, "optimizers", None) or []:
        found += _optimizer_tree(sub)
    return found


def _gated_update_step(opt: Any, gates: dict):
    orig = opt.update_step

    def update_step(gradient, variable, learning_rate):
        gate = gates.get(opt._var_key(variable))
        if gate is None:
            return orig(gradient, variable, learning_rate)
        return ops.cond(gate, lambda: _none(orig(gradient, variable, learning_rate)), lambda: None)

    return update_step


def _gated_weight_decay(opt: Any, gates: dict):
    orig = opt._apply_weight_decay

    def apply_weight_decay(variables):
        variables = list(variables)
        orig([v for v in variables if opt._var_key(v) not in gates])
        for v in variables:
            gate = gates.get(opt._var_key(v))
            if gate is not None:
                ops.cond(gate, lambda v=v: _none(orig([v])), lambda: None)

    return apply_weight_decay


def _is_tensor_like(value: Any) -> bool:
    return hasattr(value, "dense_shape") or ops.is_tensor(value) or isinstance(value, keras.Variable)


def _path(variable: Any) -> str:
    """``keras.Variable.path``, or a ``tf.Variable``'s name."""
    return getattr(variable, "path", None) or variable.name


def _op_name(path: str) -> str:
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in path)


def _outside_functions():
    """Eager context even while a ``tf.function`` is being traced (TF only)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()
