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
            optimizer (no accumulator slots are created).
        reduction: ``"mean"`` (default) applies ``sum / N``, equivalent to the
            large batch for a mean-reduced loss; ``"sum"`` applies the sum.
        name: optional name of the wrapper.

    State (all ``keras.Variable``s, saved wherever Keras saves optimizer
    state):
        ``micro_steps``: int64 scalar, micro-steps taken (units: micro-steps).
        ``iterations``: the inner optimizer's int64 counter, i.e. updates
            taken (units: updates). After ``m`` micro-steps,
            ``iterations == m // N`` and ``micro_steps == m``.
        ``acc_grads``: accumulator slots, shape and dtype of each trainable
            variable. Under ``tf.distribute`` they are ``ON_READ`` variables
            (each replica keeps its local sum; reading them in cross-replica
            context, as saving does, gives the sum over replicas).
        ``grad_received``: int64 vector ``(num_trainable_variables,)``, 1
            where a variable has had a gradient in the current window.

    Missing gradients: a ``None`` gradient contributes nothing on that
    micro-step; a variable with no gradient in the whole window is not
    updated (neither its weight, its slots, nor its weight decay), as in
    large-batch training. Sparse ``tf.IndexedSlices`` gradients are
    scatter-added into the slots, never densified per micro-step.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras 3 optimizer, or
            ``gradient_accumulation_steps`` is not an int.
        ValueError: ``gradient_accumulation_steps < 1``; ``reduction`` not in
            ``("mean", "sum")``; the inner optimizer already accumulates;
            base-optimizer arguments (``clipnorm``, ``weight_decay``, ...) are
            passed to the wrapper instead of the inner optimizer.
    """

    def __init__(
        self,
        inner_optimizer: Any = acc_lib.REQUIRED,
        gradient_accumulation_steps: int = acc_lib.REQUIRED,
        reduction: str = "mean",
        name: str | None = None,
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
        acc_lib.check_arguments(inner_optimizer, gradient_accumulation_steps, kwargs)
        steps = acc_lib.validate_gradient_accumulation_steps(gradient_accumulation_steps)
        reduction = acc_lib.validate_reduction(reduction)
        inner = _resolve_inner(inner_optimizer)

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
        self._deferred_state: dict[str, np.ndarray] | None = None
        # Like Keras' `iterations`, the micro-step counter exists before
        # `build`, so that restoring it (load_weights before the first step)
        # shows at once.
        with keras.name_scope(self.name, caller=self):
            # (Tracked by the attribute assignment, as Keras tracks variables.)
            self.micro_steps = keras.Variable(
                0, name="micro_steps", dtype="int", trainable=False, aggregation="only_first_replica"
            )

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """N, micro-steps per update (read-only: fixed at construction)."""
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
        var_list = list(var_list)
        for v in var_list:
            if self.gradient_accumulation_steps > 1 and self._overwrite_variable_with_gradient(v):
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
            if self.gradient_accumulation_steps > 1:
                self.grad_received = self.add_variable(
                    shape=(len(var_list),),
                    dtype="int",
                    aggregation="only_first_replica",
                    name="grad_received",
                )
                self.acc_grads = [self._add_accumulator(v) for v in var_list]
            else:
                self.grad_received = None
                self.acc_grads = []
        self.inner_optimizer.build(var_list)
        self.built = True
        if self._deferred_state is not None:
            state, self._deferred_state = self._deferred_state, None
            # `build` may run inside the first traced train step; the restore
            # must happen now, not in a graph that tf.function may discard.
            with _outside_functions():
                self.load_own_variables(state)

    def _add_accumulator(self, reference: Any) -> Any:
        """One slot per trainable variable: a replica-local (``ON_READ``,
        summed on read) zero-initialised copy of its shape and dtype."""
        name = f"{_path(reference).replace('/', '_').replace(':', '_')}_acc_grad"
        with self._colocate_with(reference):
            variable = keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=reference.shape,
                dtype=reference.dtype,
                trainable=False,
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
        ``acc_grads``) followed by all of the inner optimizer's."""
        own = [v for v in self._variables if not any(v is u for u in self._unused_base_variables)]
        return own + self.inner_optimizer.variables

    def __dir__(self):
        # Keras' saving walks `dir()` for child objects to save. The inner
        # optimizer's variables are already in this optimizer's `variables`
        # (saved and restored together, deferred until build if need be), so
        # hide it there: otherwise its state is written twice and, on an
        # unbuilt optimizer, Keras warns that it skipped it.
        return [a for a in super().__dir__() if a != "inner_optimizer"]

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

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`save_own_variables`.

        On an optimizer that is not built yet the values are kept and
        restored by :meth:`build` (Keras itself would skip them with a
        warning). An empty store (weights saved without optimizer state)
        restores nothing.

        Raises:
            ValueError: if the number of saved variables does not match.
        """
        if len(store.keys()) == 0:
            return  # weights saved without optimizer state: nothing to restore
        if not self.built:
            self._deferred_state = {k: np.asarray(store[k]) for k in store.keys()}
            self._restore_counters(self._deferred_state)
            return
        variables = self.variables
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Cannot restore optimizer '{self.name}': it has "
                f"{len(variables)} variables but the saved state has "
                f"{len(store.keys())}. Was it saved with a different inner "
                "optimizer, gradient_accumulation_steps or model? To load only "
                "the model's weights, use keras.saving.load_weights(model, "
                "path, objects_to_skip=[model.optimizer]) on a .weights.h5 file."
            )
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def _restore_counters(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore, before build, the two counters that already exist:
        ``micro_steps`` and the inner ``iterations`` (what resume idioms read
        to compute ``initial_epoch``). The rest waits for :meth:`build`,
        which checks that the whole state fits.

        The saved order is :attr:`variables`: ``micro_steps``, then (N > 1)
        ``grad_received`` of shape ``(n,)`` and ``n`` accumulators, then the
        inner optimizer's variables, ``iterations`` first.
        """
        inner_vars = self.inner_optimizer.variables
        if not inner_vars or inner_vars[0] is not self.inner_optimizer.iterations:
            return
        own = 1
        if self.gradient_accumulation_steps > 1:
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
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Take one micro-step with ``grads`` for ``trainable_variables``.

        ``grads[i]`` is the gradient of the micro-batch loss for
        ``trainable_variables[i]`` (a dense tensor of the variable's shape, a
        ``tf.IndexedSlices``, or ``None``). Without ``trainable_variables``
        the gradients must match the variables the optimizer was built with.

        Raises:
            ValueError: lengths differ; a gradient's shape differs from its
                variable's; every gradient is ``None``; a variable is unknown.
        """
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
        _check_gradient_shapes(grads, trainable_variables)
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

        import tensorflow as tf

        if self.gradient_accumulation_steps == 1:
            # Pass-through; its writes, too, wait for the gradients (see
            # `_accumulation`: a phantom call at the end of an input of
            # unknown length must not count).
            with tf.control_dependencies(acc_lib.gradient_tensors(grads)):
                self.inner_optimizer.apply(grads, trainable_variables)
                self.assign_add(self.micro_steps, 1)
            return
        # Put the gradients in build order; variables absent from this call
        # get None (no contribution this micro-step).
        full = [None] * len(self._trainable_variables)
        for g, v in zip(grads, trainable_variables):
            full[self._get_variable_index(v)] = g
        self._tf_apply(full)

    def _tf_apply(self, grads: list) -> None:
        """TensorFlow path: the only place that knows about ``tf.distribute``.

        Under a strategy that needs ``merge_call`` (``MirroredStrategy``), the
        ``cond`` that picks update steps must run in cross-replica context,
        because the inner optimizer's update calls ``merge_call`` and a
        ``merge_call`` inside a replica-context ``cond`` fails (the crash of
        Keras' built-in accumulation). So, as ``LossScaleOptimizer._tf_apply``
        does: one ``merge_call``; each replica adds its local gradients into
        its local (``ON_READ``) slots; the counters move once; and on update
        steps each replica hands its local window gradient to the inner
        optimizer, whose usual all-reduce is the one cross-replica reduction
        of the window. Strategies that need no ``merge_call`` run the
        micro-step in each replica directly.
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
        if not tf.distribute.has_strategy() or (
            tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            self._micro_step(checked)
            return
        tf.distribute.get_replica_context().merge_call(self._cross_replica_step, args=(checked,))

    def _cross_replica_step(self, distribution: Any, grads: list) -> None:
        # Runs once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        def each_replica(fn, *args):
            return distribution.extended.call_for_each_replica(fn, args=args)

        self._micro_step(grads, each_replica)

    def _micro_step(self, grads: list, each_replica: Any = None) -> None:
        acc_lib.micro_step(
            _KerasBackend(self),
            acc_lib.WindowState(self.acc_grads, self.micro_steps, self.grad_received),
            grads,
            self._apply_inner,
            self.gradient_accumulation_steps,
            self.reduction,
            each_replica,
        )

    def _apply_inner(self, window_grads: list, gates: dict) -> None:
        with self._gate_inner_updates(gates):
            self.inner_optimizer.apply(window_grads, self._trainable_variables)

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
        """
        if not gates:
            yield
            return
        gates = {self._var_key(self._trainable_variables[i]): g for i, g in gates.items()}
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
        try:
            yield
        finally:
            for opt in patched:
                object.__delattr__(opt, "update_step")
                object.__delattr__(opt, "_apply_weight_decay")
            for v, c in constrained:
                v.constraint = c

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "reduction": self.reduction,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "AccumulatingOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


class _KerasBackend:
    """:class:`_accumulation.Backend` for Keras 3 on TensorFlow: the
    optimizer's own ``assign``/``assign_add`` (``IndexedSlices`` become
    scatter ops) and ``keras.ops.cond``."""

    def __init__(self, optimizer: keras.optimizers.Optimizer) -> None:
        self._opt = optimizer

    def assign(self, variable: Any, value: Any) -> None:
        self._opt.assign(variable, value)

    def assign_add(self, variable: Any, value: Any) -> None:
        self._opt.assign_add(_replica_local(variable, value), value)

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> None:
        import tensorflow as tf

        value = tf.IndexedSlices(updates, indices)
        self._opt.assign(_replica_local(variable, value), value)

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


def _static_shape(value: Any) -> tuple | None:
    dense_shape = getattr(value, "dense_shape", None)  # tf.IndexedSlices
    if dense_shape is not None:
        try:
            import tensorflow as tf

            static = tf.get_static_value(dense_shape)
        except Exception:  # pragma: no cover - non-TF sparse types
            static = None
        return None if static is None else tuple(int(d) for d in static)
    shape = getattr(value, "shape", None)
    if shape is None or getattr(shape, "rank", 0) is None:  # unknown rank
        return None
    return tuple(None if d is None else int(d) for d in shape)


def _check_gradient_shapes(grads: Sequence[Any], variables: Sequence[Any]) -> None:
    for g, v in zip(grads, variables):
        if g is None:
            continue
        g_shape, v_shape = _static_shape(g), tuple(v.shape)
        if g_shape is None or len(g_shape) != len(v_shape):
            if g_shape is not None:
                _raise_shape(g_shape, v)
            continue
        if any(a is not None and b is not None and a != b for a, b in zip(g_shape, v_shape)):
            _raise_shape(g_shape, v)


def _raise_shape(g_shape: tuple, v: Any) -> None:
    raise ValueError(
        f"Gradient shape {g_shape} does not match the shape {tuple(v.shape)} "
        f"of variable {_path(v)!r}; each gradient must have "
        "its variable's shape."
    )
