"""`AccumulatingOptimizer` for Keras 3, on the TensorFlow, JAX and torch backends.

Modelled on Keras 3's ``keras.optimizers.LossScaleOptimizer``
(``keras/src/optimizers/loss_scale_optimizer.py``): a wrapper with its own
variables plus the inner optimizer's, forwarding ``learning_rate``,
``iterations`` and ``scale_loss``, serializing the inner optimizer in
``get_config``. What it shares with the Keras 2 and legacy families (build
order, gating, pass-through, flush) is
:mod:`accum_optimizer.families._accumulating`; its route on TensorFlow (the
``tf.distribute`` route, ``tf.function``) is
:mod:`accum_optimizer.families._tf_route`, on JAX and torch (``keras.ops``,
``stateless_apply``) :mod:`accum_optimizer.families._keras_ops_route`; the algorithm is
:mod:`accum_optimizer.core`; Keras' private symbols are
:mod:`accum_optimizer._compat.keras3`.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterable, Sequence

import keras

from accum_optimizer import _args, _compat, core
from accum_optimizer.core import layout

from accum_optimizer._compat import keras3 as compat
from accum_optimizer.families import _accumulating
from accum_optimizer.families._accumulating import deserialize_schedule, serialize_schedule, variable_name
from accum_optimizer.families import keras3_float8 as float8
from accum_optimizer.families.keras3_jax import DeviceAccumulators
from accum_optimizer.families.keras3_saving import Keras3Saving

if not str(keras.__version__).startswith("3."):  # Keras 2.x is `keras` on TF <= 2.15
    raise ImportError(f"{__name__} needs Keras 3; `import keras` is Keras {keras.__version__} here.")

BACKENDS = ("tensorflow", "jax", "torch")
"""The Keras backends the wrapper runs on."""

if keras.backend.backend() == "tensorflow":
    from accum_optimizer.families import _tf_route as _route
    from accum_optimizer.families._tf_route import TFRoute as Route
else:  # (another backend is refused when a wrapper is made: _check_environment)
    from accum_optimizer.families import _keras_ops_route as _route
    from accum_optimizer.families._keras_ops_route import KerasOpsRoute as Route

_INNER_ONLY_ARGS = {**_args.KERAS_OPTIMIZER_ARGUMENTS, "loss_scale_factor": None}


@keras.saving.register_keras_serializable(package="accum_optimizer")
class AccumulatingOptimizer(compat.KerasReads, _compat.ForwardsSettings, Keras3Saving, DeviceAccumulators,
                            Route, keras.optimizers.Optimizer):
    """Accumulate gradients over micro-batches, update once per window.

    Each call to :meth:`apply` / :meth:`apply_gradients` is one *micro-step*:
    the gradients are added into accumulator slots (one non-trainable
    variable per trainable variable, same shape). On every
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
              would. It costs nothing: no check, no extra reduction. Under
              ``"mixed_float16"`` the ``LossScaleOptimizer`` that ``compile``
              puts outside already checks every micro-step and skips an
              overflowing one before it reaches this optimizer.
            * ``"skip_micro_step"``: the micro-batch is dropped and not
              counted (``micro_steps`` does not move, ``skipped_micro_steps``
              does); the window takes one more micro-batch. What a
              ``LossScaleOptimizer`` outside does, without loss scaling.
            * ``"skip_window"``: the micro-step counts towards its window but
              adds nothing, and the window's last micro-step discards the
              window instead of updating (accumulators zeroed, inner optimizer
              not called, ``iterations`` unchanged, ``skipped_windows += 1``),
              as a large batch containing that micro-batch would skip its
              step. With a ``LossScaleOptimizer`` outside, a micro-step that
              it skips never reaches this optimizer; the wrapper finds that
              ``LossScaleOptimizer`` when it is built (it is the caller of
              :meth:`build`) and learns of the micro-steps it skips, which
              then count and discard their window in the same way.

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

    State (all ``keras.Variable`` s, saved wherever Keras saves optimizer
    state, in the order of :attr:`variables`):
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
        ``acc_grads``: accumulator slots, shape of each trainable variable.
            Under ``tf.distribute`` they are ``ON_READ`` variables (each
            replica keeps its local sum; reading them in cross-replica
            context, as saving does, gives the sum over replicas).
        ``grad_received``: int64 vector ``(num_trainable_variables,)``, 1
            where a variable has had a gradient in the current window.
        ``skipped_micro_steps``, ``skipped_windows`` (skipping policies only,
            ``None`` under ``"propagate"``): int64 scalars, non-finite
            micro-steps dropped (including those a ``LossScaleOptimizer``
            outside skipped) and windows discarded. Under
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
            Replica-local (``ON_READ``) like the accumulators. State saved
            without them (by earlier versions) restores with every row whose
            accumulator is non-zero marked.

    Missing gradients: a ``None`` gradient contributes nothing on that
    micro-step; a variable with no gradient in the whole window is not
    updated (neither its weight, its slots, nor its weight decay), as in
    large-batch training.

    Sparse gradients: ``tf.IndexedSlices`` (from ``Embedding``) are
    scatter-added into the slots, never densified per micro-step, and their
    rows are marked in the variable's tracker. When the window closes on a
    sparse gradient (or on none), plain ``SGD`` (``momentum=0``) gets the
    window gradient as ``tf.IndexedSlices`` over the touched rows, each once,
    and applies it as a scatter; every other inner optimizer would densify
    the slices itself, so it gets the dense window gradient. Either way only
    the touched rows of the accumulator are zeroed afterwards. A variable
    whose gradient on the closing micro-step is dense (a tied embedding)
    takes the dense path for that window.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras 3 optimizer, or
            ``gradient_accumulation_steps`` is not an int, dict or callable.
        ValueError: ``gradient_accumulation_steps < 1``; ``reduction`` not in
            ``("mean", "sum")``; the inner optimizer already accumulates;
            base-optimizer arguments (``clipnorm``, ``weight_decay``, ...) are
            passed to the wrapper instead of the inner optimizer.
        NotImplementedError: Keras runs a backend other than TensorFlow, JAX
            or torch (``numpy``, ``openvino``: no training).

    Backends: the same class on TensorFlow, JAX and torch
    (``docs/families/backends.md``). On JAX and torch it also has
    ``stateless_apply(optimizer_variables, grads, trainable_variables,
    weight=None)`` and ``stateless_flush(optimizer_variables,
    trainable_variables)`` for ``jax.jit`` loops
    (:class:`accum_optimizer.families._keras_ops_route.KerasOpsRoute`); the
    ``tf.distribute`` behaviour and sparse (``tf.IndexedSlices``) windows
    above are TensorFlow's.
    """

    _FAMILY = "Keras 3"
    _INNER_ONLY = _INNER_ONLY_ARGS
    _NONFINITE = core.NONFINITE_POLICIES

    def _check_environment(self) -> None:
        if keras.backend.backend() not in BACKENDS:
            raise NotImplementedError(
                "AccumulatingOptimizer supports Keras 3 on the backends "
                f"{', '.join(BACKENDS)}; this Keras runs the {keras.backend.backend()!r} "
                "backend (KERAS_BACKEND). Use KERAS_BACKEND=jax, torch or tensorflow."
            )

    def _check_accumulator_dtype(self, value: Any) -> str | None:
        return _validate_accumulator_dtype(value)

    def _inner_spec(self) -> _args.InnerSpec:
        return _args.InnerSpec(
            "a Keras 3 optimizer instance (`keras.optimizers.Optimizer`, e.g. keras.optimizers.Adam())",
            keras.optimizers.Optimizer, keras.optimizers.get, "keras.optimizers.get",
            keras.optimizers.LossScaleOptimizer,
        )

    def _base_arguments(self, args: _args.Arguments) -> dict:
        return {"learning_rate": 0.0, "name": args.name}

    def _init_state(self, args: _args.Arguments) -> None:
        # The base class made its own `iterations` and `learning_rate`
        # variables (all it has tracked so far); ours forward to the inner
        # optimizer, so `variables` (and so the saved state) leaves them out.
        self._window.left_out = tuple(super().variables)
        self.inner_optimizer = args.inner
        self.reduction = args.reduction
        self.nonfinite = args.nonfinite
        self.accumulator_dtype = args.accumulator_dtype
        self._remember_strategy()
        # The optional trailing blocks of the saved layout (see `variables`).
        self._window.blocks = {"nonfinite": [], "window": [], "trackers": []}
        self.skipped_micro_steps = self.skipped_windows = self.window_poisoned = None
        self.mini_step = self.window_weight = self.grad_received = None
        self.touched_rows = []
        # Like Keras' `iterations`, the micro-step counter exists before
        # `build`, so that restoring it (load_weights before the first step)
        # shows at once. (Tracked by the attribute assignment.)
        with keras.name_scope(self.name, caller=self):
            self.micro_steps = keras.Variable(
                0, name="micro_steps", dtype="int", trainable=False, aggregation="only_first_replica"
            )

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulator slots, counters and the inner's variables.

        Not run under ``no_automatic_dependency_tracking`` (unlike
        ``LossScaleOptimizer.build``), so that variables the inner optimizer
        creates as plain attributes (Nadam's ``_u_product``) stay tracked and
        saved.

        Variables with ``overwrite_with_gradient=True`` (the scales and amax
        histories of ``model.quantize("float8")``) are accumulated by
        element-wise maximum and overwritten once per window
        (``WindowState.combine``; see :meth:`scale_loss`).
        """
        if self.built:
            # LossScaleOptimizer.build builds its inner optimizer again even
            # when it is built (LossScaleOptimizer(built_wrapper)): keep the
            # state, only look for the new outer optimizer.
            self._attach_outer(compat.outer_loss_scale_optimizer(self))
            return
        var_list = list(var_list)
        if self._accumulates:
            self._check_strategy_at_build()
        self._set_build_order(var_list)
        with keras.name_scope(self.name, caller=self):
            state = _accumulating.make_window(self, var_list, self._make_state)
            self.touched_rows = state["blocks"].get("trackers", [])  # (tracked for checkpoints)
        self.inner_optimizer.build(var_list)
        self._link_followers(var_list)
        self.built = True
        # `build` may run inside the first traced train step; restores must
        # happen now, not in a graph that tf.function may discard.
        state = self._window.take_deferred()
        if state is not None:
            with self._outside_functions():
                self.load_own_variables(state)
        self._attach_outer(compat.outer_loss_scale_optimizer(self))

    def _make_state(self, spec: layout.Spec, variable: Any) -> keras.Variable:
        """One variable of the window (:func:`~accum_optimizer.families._accumulating.make_window`)."""
        if spec.name == "acc_grad":
            return self._accumulator(variable)
        if spec.name == "touched_rows":
            return self._replica_local(variable, spec.name, spec.shape, spec.dtype, autocast=False)
        if spec.replica_local:  # window_weight
            return compat.track_variable(self, keras.Variable(
                initializer=keras.initializers.Zeros(), shape=spec.shape, dtype=spec.dtype, trainable=False,
                aggregation="sum", synchronization="on_read", name=spec.name,
            ))
        return self.add_variable(shape=spec.shape, dtype="int", aggregation="only_first_replica", name=spec.name)

    def _key_of(self, variable: Any) -> Any:
        return compat.var_key(self, variable)

    def _accumulator_dtype(self, variable: Any) -> str:
        return _args.accumulator_dtype_for(keras.backend.standardize_dtype(variable.dtype), self.accumulator_dtype)

    def _replica_local(
        self, reference: Any, kind: str, shape: Any, dtype: str, autocast: bool = True, layout: Any = None
    ) -> keras.Variable:
        """A zero-initialised replica-local (``ON_READ``, summed on read)
        variable beside ``reference`` (an accumulator, a row tracker).

        Under a ``keras.distribution`` (JAX) it has ``reference``'s layout
        (:func:`_layout_beside`), as Keras' own optimizer variables do.
        Row trackers are float16: restoring a summed ``ON_READ`` variable
        divides the saved sum by the replica count, which turns an integer
        mark of 1 into 0 but a float16 one into 0.5 (still a mark).
        ``layout``: another layout (per-device accumulators)."""
        name = f"{variable_name(reference).replace('/', '_').replace(':', '_')}_{kind}"
        with self._colocated_with(reference):
            variable = keras.Variable(
                initializer=keras.initializers.Zeros(), shape=shape, dtype=dtype, trainable=False,
                autocast=autocast, aggregation="sum", synchronization="on_read", name=name,
                layout=layout or _layout_beside(reference, len(shape)),
            )
        return compat.track_variable(self, variable)

    def _hands_slices(self) -> bool:
        """Does the inner optimizer apply a ``tf.IndexedSlices`` gradient as a
        sparse update (cost O(rows)), so that a sparse window should reach it
        as slices over the touched rows (a trace-time decision)?

        True only for ``keras.optimizers.SGD`` (or a subclass that keeps its
        ``update_step``) with ``momentum == 0``: its update is
        ``assign_sub(variable, gradient * lr)``, a ``scatter_sub`` for slices.
        With momentum, SGD computes ``m * momentum - gradient * lr``, which
        densifies the slices; Adam, Adamax, Nadam, AdamW, Ftrl, Lion, RMSprop
        with momentum do the same. For those, handing slices would only add
        a gather, a densification and, with repeated ids, a different result:
        they get the dense window gradient.
        """
        inner = self.inner_optimizer
        return type(inner).update_step is keras.optimizers.SGD.update_step and float(inner.momentum) == 0.0

    @property
    def variables(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        ``acc_grads``), all of the inner optimizer's, then those of the
        skipping policies (``skipped_micro_steps``, ``skipped_windows``,
        ``window_poisoned``), then the window's ``mini_step`` and
        ``window_weight``, then the row trackers (``touched_rows``, one per
        variable of rank >= 1): last, so that state saved without them (by
        ``"propagate"``, by 0.1.0, by versions before the window position or
        the trackers) is a prefix of the state saved with them."""
        return self._saved_variables()

    _LAYOUT_NAME = "keras3"
    _LAYOUT = layout.LAYOUTS["keras3"]

    def _saved_blocks(self) -> dict:
        window = self._window
        left_out = {id(v) for v in itertools.chain(window.left_out, window.block_variables())}
        own = [v for v in super().variables if id(v) not in left_out]
        return {"own": own, "inner": list(self.inner_optimizer.variables), **window.blocks}

    def __dir__(self) -> list:
        return compat.hidden_from_saving_walk(super().__dir__())

    def scale_loss(self, loss: Any) -> Any:
        """The inner optimizer's ``scale_loss(loss)``; for a model with
        float8 layers (variables with ``overwrite_with_gradient=True``,
        built, accumulating, ``reduction="mean"``) also divided by the
        window's N.

        A float8 layer records the largest output gradient of each step in
        its ``outputs_grad_amax_history`` and scales the next steps' output
        gradients by it. The large batch's loss is a mean over ``N·B``
        samples, a micro-batch's over ``B``: its output gradients are ``N``
        times the large batch's. Divided by N, the micro-batch's backward
        pass sees the large batch's units, so the window's maximum is the
        large batch's amax and the output gradients are quantized with the
        large batch's scale. The next :meth:`apply` in the same train step
        multiplies the other gradients back by N (float8 state excepted),
        so the weights see the unscaled mean. ``fit`` calls this; a custom
        train step should too, as for a loss scale (without it, the float8
        output-gradient history is kept in micro-batch units, Keras'
        built-in accumulation's). A ``LossScaleOptimizer`` outside, whose
        ``scale_loss`` is what ``fit`` calls, divides by N the same way.

        Args:
            loss: scalar tensor.

        Returns:
            The scaled loss, same dtype.
        """
        return self._float8_scaled(self.inner_optimizer.scale_loss(loss))

    # -- float8 state (accum_optimizer.families.keras3_float8)
    def _float8_scaled(self, loss: Any) -> Any:
        return float8.scaled(self, loss)

    def _combine(self) -> list | None:
        return float8.combine(self._build_order)

    def _checked_gradients(self, grads: Sequence[Any], variables: list) -> list:
        return float8.unscaled(self, super()._checked_gradients(grads, variables), variables)

    def _apply_inner(self, window_grads: list, gates: dict) -> Any:
        return super()._apply_inner(float8.kept_values(window_grads, gates, self._build_order), gates)

    # What Keras' own code reads (or writes) on whatever optimizer it is given,
    # unwrapping `inner_optimizer` at most once (LossScaleOptimizer, the
    # callbacks): answered by the inner optimizer, which owns them.
    use_ema = _args.forwarded("use_ema")
    ema_momentum = _args.forwarded("ema_momentum")
    ema_overwrite_frequency = _args.forwarded("ema_overwrite_frequency")
    loss_scale_factor = _args.forwarded("loss_scale_factor")
    clipnorm = _args.forwarded("clipnorm")
    global_clipnorm = _args.forwarded("global_clipnorm")
    clipvalue = _args.forwarded("clipvalue")
    weight_decay = _args.forwarded("weight_decay")
    optimizers = _args.forwarded("optimizers", writable=False)

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Forwarded to the inner optimizer, which owns the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------ micro-step
    @_route.unconverted
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None) -> Any:
        """:meth:`apply` with ``(gradient, variable)`` pairs; returns
        ``iterations`` (updates taken)."""
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight)
        return self.iterations

    @_route.unconverted
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
        weight = self._micro_step_weight(weight)
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "AccumulatingOptimizer.apply(grads) without "
                    "`trainable_variables` needs a built optimizer; call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._build_order
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length. "
                f"Received {len(grads)} gradients for "
                f"{len(trainable_variables)} variables."
            )
        if not grads:
            return
        self._take_micro_step(grads, trainable_variables, weight)

    def _before_micro_step(self, grads: list, variables: list) -> None:
        missing = [variable_name(v) for g, v in zip(grads, variables) if g is None]
        if missing:
            # Keras' own warning, word for word (once per trace, as plain Keras).
            warnings.warn(
                f"Gradients do not exist for variables {missing} when minimizing the loss. "
                "If using `model.compile()`, did you forget to provide a `loss` argument?"
            )

    def _build_on_first_use(self, variables: list) -> None:
        # (On TensorFlow the route builds outside the function being traced:
        # see `_tf_route.TFRoute._build_on_first_use`.)
        with keras.name_scope(self.name, caller=self):
            super()._build_on_first_use(variables)

    def _update_inner(self, grads: list, variables: list) -> None:
        self.inner_optimizer.apply(grads, variables)

    def _writer(self) -> Any:
        return self

    def _fence_variables(self) -> Any:
        # The inner update's writes that read no gradient: its counters
        # (`iterations += 1`; scalars) and weight decay (the model's
        # variables). Its slots are written from the gradient, and an EMA
        # from the variables after their update.
        return lambda: [*(v for v in self.inner_optimizer.variables if len(v.shape) == 0), *self._build_order]

    def _install_gates(self, gates: dict) -> Any:
        return compat.install_gates(self.inner_optimizer, self._build_order, gates, self._gate_cond())

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "gradient_accumulation_steps": serialize_schedule(keras, self.gradient_accumulation_steps),
            "reduction": self.reduction,
            "nonfinite": self.nonfinite,
            "accumulator_dtype": self.accumulator_dtype,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "AccumulatingOptimizer":
        config = deserialize_schedule(keras, dict(config), custom_objects)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)





def _layout_beside(reference: Any, rank: int) -> Any:
    """The layout of a per-variable state of rank ``rank`` beside ``reference``:
    ``reference``'s own layout (what the current ``keras.distribution``'s
    ``get_variable_layout`` gives it: the layout it was created with, or the
    distribution's ``LayoutMap`` entry for its path), restricted to its first
    ``rank`` axes (a row tracker: the first axis); ``None`` without a
    distribution (the backend's default placement: the variables that
    ``tf.distribute`` creates beside their variable on TensorFlow) or for a
    layout that is not a ``keras.distribution.TensorLayout`` cut to a lower
    rank (the distribution's default for the state's own path)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    layout = distribution.get_variable_layout(reference)
    if rank == len(reference.shape) or layout is None:
        return layout
    if not isinstance(layout, keras.distribution.TensorLayout):
        return None
    return keras.distribution.TensorLayout(layout.axes[:rank], layout.device_mesh)





def _validate_accumulator_dtype(value: Any) -> str | None:
    if value is None:
        return None
    try:
        dtype = keras.backend.standardize_dtype(value)
    except (ValueError, TypeError):
        dtype = None
    if dtype is None or not keras.backend.is_float_dtype(dtype):
        raise _args.bad_accumulator_dtype(value)
    return dtype
