"""`AccumulatingOptimizer` for Keras 2 legacy ``OptimizerV2`` and tensorflow-addons.

Wraps any ``tf.keras.optimizers.legacy.Optimizer`` of a Keras 2 package
(``keras`` 2.x on TF <= 2.15, or ``tf_keras``): the built-in legacy
optimizers and every tensorflow-addons optimizer (tfa's ``Lookahead``,
``MovingAverage``, ``SWA`` and ``MultiOptimizer`` included). The wrapper is
itself an ``OptimizerV2`` of the inner optimizer's package (one class per
package, :mod:`~accum_optimizer.families._keras2`), so that package's
``model.compile`` accepts it.

Design: the override is at the level of ``apply_gradients``, not of the
per-variable hooks (``_create_slots``, ``_resource_apply_*``) that tfa's
``average_wrapper.py`` delegates. ``OptimizerV2.apply_gradients``
all-reduces the gradients, clips them and increments ``iterations`` around
the per-variable hooks, so a hook-level wrapper would do all that every
micro-step and count micro-steps. Overriding ``apply_gradients`` keeps it in
the inner optimizer's own ``apply_gradients``, called once per update (in
each replica, with that replica's window gradient), through the route the
three ``tf.function`` families share (:mod:`~accum_optimizer.families._tf_route`).
The wrapper's own per-variable hooks refuse to run: a tfa wrapper *around*
this one (``Lookahead(AccumulatingOptimizer(...))``) would drive them every
micro-step, so it gets a clear error before any weight moves.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Iterable, Sequence

import tensorflow as tf

from accum_optimizer import _args, core
from accum_optimizer.core import layout
from accum_optimizer._compat import keras2 as compat
from accum_optimizer._compat import tf as tf_compat
from accum_optimizer.families import _accumulating, _keras2, _tf_route

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


def _base_of(package: Any) -> Any:
    return getattr(getattr(getattr(package, "optimizers", None), "legacy", None), "Optimizer", None)


def package_of(optimizer: Any) -> Any:
    """The imported Keras 2 package whose legacy ``Optimizer`` ``optimizer``
    is an instance of (``keras`` 2.x or ``tf_keras``), or ``None``."""
    return _keras2.package_of(optimizer, _base_of)


class _LegacyAccumulating(tf_compat.InnerSlots, compat.LegacyHooks, _keras2.PerPackage, _tf_route.TFRoute):
    """Accumulate gradients over micro-batches, update once per window
    (Keras 2 legacy ``OptimizerV2`` and tensorflow-addons).

    Each call to :meth:`apply_gradients` (``minimize``, ``model.fit``'s train
    step) is one *micro-step*: the gradients are added into accumulators. On
    every ``gradient_accumulation_steps``-th micro-step the inner optimizer's
    own ``apply_gradients`` is called once with the window's gradient and
    the accumulators are zeroed. Between updates the model weights and all
    of the inner optimizer's state (slots, ``iterations``, hyperparameters,
    tfa's Lookahead slow weights and MovingAverage/SWA averages) stay bitwise
    untouched. The arguments and semantics are the Keras 3 family's
    (:class:`accum_optimizer.families.keras3.AccumulatingOptimizer`), with
    these differences:

    * ``inner_optimizer``: a legacy ``OptimizerV2`` of this class' Keras 2
      package (``tf.keras.optimizers.legacy.*``, a tensorflow-addons
      optimizer, tfa's ``Lookahead``/``MovingAverage``/``SWA``/
      ``MultiOptimizer`` around one), or an identifier that
      ``optimizers.get(..., use_legacy_optimizer=True)`` resolves.
    * ``nonfinite`` and ``accumulator_dtype`` as in Keras 3 (the skip
      counters are weights of the wrapper, after the row trackers). With a
      ``LossScaleOptimizer`` outside, a micro-step it skips never reaches this
      optimizer (neither counted nor discarding its window).
    * ``mini_step`` is -1 ("unknown") until the first micro-step or
      :meth:`flush`, which derive it from ``micro_steps``: weights saved
      before it existed resume exactly.
    * Sparse gradients (``tf.IndexedSlices``) are scatter-added, and the
      update hands the inner optimizer ``tf.IndexedSlices`` over the
      window's touched rows (each once): lazy optimizers (tfa ``LazyAdam``,
      momentum ``SGD``) then leave the rows no micro-batch looked up
      untouched, as in the sparse large batch. Row trackers are float16
      ``(shape[0],)`` vectors (a float, so that a summed ``ON_READ`` mark
      survives a restore across replicas).
    * A variable with no gradient in the whole window gets no update, no tfa
      decoupled weight decay and no constraint.
    * The inner optimizer's hyperparameters and clip settings are read and
      assigned through the wrapper (``opt.beta_1``, ``opt.epsilon``,
      ``opt._get_hyper("beta_1")``, ``opt.clipnorm = 1.0``), and its public
      methods that the wrapper lacks called through it (tfa's
      ``opt.assign_average_vars(model.variables)``), as on the optimizer
      compiled with (:class:`accum_optimizer._compat.ForwardsSettings`);
      ``apply_gradients`` and ``minimize`` are always the wrapper's.
    * In a ``tf.compat.v1`` graph (TF1-style code, Keras 2's graph-mode
      ``fit``) :meth:`apply_gradients`, ``minimize`` and :meth:`flush`
      return the op to run, as ``OptimizerV2`` does.
    * ``decay_var_list`` (tensorflow-addons' decoupled weight decay) is
      taken by :meth:`apply_gradients` and ``minimize`` and applied once per
      update.
    * ``get_slot(var, "m")`` and ``get_slot_names()`` read the inner
      optimizer's slots, and ``add_slot`` adds to them (the wrapper has none
      of its own); a ``tf.train.Checkpoint`` saves them once, under the
      inner optimizer, and its restore recreates them there.
    * ``copy.deepcopy`` gives a wrapper that trains like this one from
      there, as a plain ``OptimizerV2``'s deep copy does (:meth:`__deepcopy__`).

    State (saved wherever Keras 2 saves optimizer weights, in :attr:`weights`
    order): ``micro_steps``, ``grad_received``, the accumulators
    (``acc_grads``) and row trackers (``touched_rows``), the skip counters
    (``skipped_micro_steps``, ``skipped_windows``, ``window_poisoned``:
    skipping policies only), the inner
    optimizer's weights, ``mini_step``, ``window_weight``.

    Raises:
        TypeError, ValueError: as the Keras 3 family's, for arguments
            (:class:`accum_optimizer._args.Constructor`).
        RuntimeError: a wrapper such as tfa's ``Lookahead`` is placed
            *around* this optimizer (raised at its first ``apply_gradients``,
            before any variable changes).
    """

    _FAMILY = "Keras 2 legacy (OptimizerV2)"
    _INNER_ONLY = _INNER_ONLY_ARGS
    _IGNORED = _IGNORED_CONFIG_KEYS

    _KIND, _API, _ALSO = "Keras 2 legacy optimizer", "optimizers.legacy", ", or a tensorflow-addons optimizer"
    _GET_ARGUMENTS = "(..., use_legacy_optimizer=True)"

    @staticmethod
    def _resolve(package: Any, identifier: Any) -> Any:
        # optimizers.get edits a config dict in place: pass a copy.
        return package.optimizers.get(copy.deepcopy(identifier), use_legacy_optimizer=True)

    def _base_arguments(self, args: _args.Arguments) -> dict:
        return {"name": args.name}

    def _init_state(self, args: _args.Arguments) -> None:
        compat.legacy_adopt(self, args.inner)
        self.inner_optimizer = args.inner
        self.reduction = args.reduction
        self._keep_numerics(args)
        self.mini_step = self.window_weight = None
        self._remember_strategy()
        # The optional trailing block of the saved layout (see `weights`).
        self._window.blocks = {"window": []}
        self._window.context["key"] = compat.legacy_var_key(self._keras)

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulators, counters and the inner optimizer's
        variables for ``var_list`` (the trainable variables, in the order
        that defines the accumulators). Runs once; later calls do nothing.
        Keras 2 calls it as ``_create_all_weights`` when it loads optimizer
        weights from an ``.h5`` file."""
        if self._window_built():
            return
        var_list = list(var_list)
        self._check_strategy_at_build()
        with tf.init_scope(), compat.legacy_strategy_scope(self):
            self.touched_rows, self.grad_received = [], None
            # (`mini_step` starts "unknown": the first micro-step or flush
            # derives it, so that a checkpoint saved without it resumes.)
            state = _accumulating.make_window(self, var_list, self._make_state)
            if self._accumulates:
                self.touched_rows = state["touched_rows"]
            compat.legacy_own_weights(self).extend(state["blocks"]["own"])
            compat.legacy_create_all_weights(self.inner_optimizer, var_list)
        self._set_build_order(var_list)
        self._link_followers(var_list)

    @property
    def built(self) -> bool:
        """Whether the accumulators and counters exist (:meth:`build` ran)."""
        return self._window_built()

    def _make_state(self, spec: layout.Spec, variable: Any) -> Any:
        """One weight of the window (:func:`~accum_optimizer.families._accumulating.make_window`)."""
        if spec.index is not None:  # an accumulator or a row tracker, beside its variable
            dtype = self._accumulator_dtype(variable) if spec.dtype is None else spec.dtype
            with _tf_route.colocated_with(self, variable):
                return self._replica_local(f"{spec.name}_{spec.index}", list(spec.shape), tf.as_dtype(dtype))
        if spec.replica_local:  # window_weight
            return self._replica_local(spec.name, list(spec.shape), tf.as_dtype(spec.dtype))
        return self.add_weight(
            spec.name, shape=list(spec.shape), dtype=tf.int64, trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            initializer=_unknown_position if spec.initial == core.UNKNOWN_POSITION else "zeros",
        )

    def _key_of(self, variable: Any) -> Any:
        return self._window.context["key"](variable)

    def _replica_local(self, name: str, shape: Any, dtype: Any) -> Any:
        return self.add_weight(
            name, shape=shape, dtype=dtype, trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )

    @property
    def weights(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        accumulators, row trackers), the inner optimizer's, then
        ``mini_step`` and ``window_weight``."""
        return self._saved_variables()

    _LAYOUT_NAME = "legacy"
    _LAYOUT = layout.LAYOUTS["legacy"]

    def _saved_blocks(self) -> dict:
        return {"own": compat.legacy_own_weights(self), "inner": list(self.inner_optimizer.weights),
                **self._window.blocks}

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`weights`), as
        ``OptimizerV2.set_weights``; weights saved before ``mini_step`` and
        ``window_weight`` existed (0.2.0.dev0 and older: all but those two)
        are accepted too, and the window's position is then
        ``micro_steps % N`` again.

        Raises:
            ValueError: the number or shapes of ``weights`` do not match.
        """
        if not self._window_built():
            super().set_weights(weights)
            return
        self._restore(list(weights), super().get_config()["name"])



    def variables(self) -> list:
        return self.weights

    def add_slot(self, var: Any, slot_name: str, initializer: Any = "zeros", shape: Any = None) -> Any:
        """Add the slot ``slot_name`` for ``var`` to the inner optimizer
        (``OptimizerV2.add_slot``: the same arguments, the slot variable
        returned; ``shape`` defaults to ``var``'s): the wrapper has no slots
        of its own, so :meth:`get_slot` finds it and a checkpoint saves it
        once, under the inner optimizer, whose restore recreates it."""
        return self.inner_optimizer.add_slot(var, slot_name, initializer=initializer, shape=shape)

    def __deepcopy__(self, memo: dict) -> Any:
        """``copy.deepcopy``: a wrapper that trains like this one from here
        on, as a deep-copied ``OptimizerV2`` does. It holds copies of the
        accumulators, counters and inner optimizer (slots, ``iterations``,
        hyperparameters: the inner optimizer's own deep copy) and applies
        them to the same model variables (which an ``OptimizerV2`` keys its
        slots by, and which are not copied), under the same
        ``tf.distribute`` strategy (a strategy cannot be copied). The layers
        that follow its windows (``accum_optimizer.layers.BatchNormalization``)
        are shared, not copied. Eagerly only (as a variable's deep copy)."""
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        state, window = self.__dict__, self._window
        shared = [*(window.build_order or ()), *window.followers, window.context.get("strategy")]
        for obj in shared:
            memo.setdefault(id(obj), obj)
        if window.context.get("flush_function") is not None:  # bound to this wrapper: the copy makes its own
            memo.setdefault(id(window.context["flush_function"]), None)
        # Straight into the copy's __dict__: the tracking records are copied
        # with the rest, so nothing is tracked twice.
        result.__dict__.update({name: copy.deepcopy(value, memo) for name, value in state.items()})
        return result

    # ------------------------------------------------------------ micro-step
    @_tf_route.unconverted
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], name: str | None = None,
                        experimental_aggregate_gradients: bool = True, weight: Any = None,
                        decay_var_list: Sequence[Any] | None = None) -> Any:
        """Take one micro-step with ``grads_and_vars``.

        ``(gradient, variable)`` pairs as for ``OptimizerV2.apply_gradients``:
        a dense tensor (or NumPy array) of the variable's shape, a
        ``tf.IndexedSlices``, or ``None`` (no contribution this micro-step).
        The first call fixes the set of variables; later calls may pass a
        subset. With ``experimental_aggregate_gradients=False`` the gradients
        are taken as already summed over replicas, and the inner optimizer is
        told so at each update.

        ``weight``: the micro-batch's count, as in the Keras 3 family's
        :meth:`~accum_optimizer.families.keras3.AccumulatingOptimizer.apply`;
        ``None``: the count a ``CountedLoss`` reported in this train step
        (``fit``), if any, else 1.

        ``decay_var_list``: for an inner optimizer with tensorflow-addons'
        decoupled weight decay (``tfa.optimizers.AdamW``, ``SGDW``, any
        ``extend_with_decoupled_weight_decay`` class): the variables that
        decay, handed to its ``apply_gradients`` at the update this
        micro-step closes (so they decay once per update, as in the large
        batch); ``None``: all of them, as there. A flush uses the list of
        the last micro-step.

        Returns:
            Building a graph (``tf.function``, or a ``tf.compat.v1`` graph
            where nothing runs unless fetched): the op of this micro-step
            (accumulation, counters and, on a window's last micro-step, the
            inner update), as ``OptimizerV2.apply_gradients`` returns its
            update op; ``sess.run`` it in TF1-style code. Eagerly: ``None``
            (read :attr:`iterations` and :attr:`micro_steps` for progress).

        Raises:
            ValueError: every gradient is ``None``; a gradient's shape differs
                from its variable's; a variable is not among those of the
                first call; called in cross-replica context; ``weight`` is not
                a scalar, is negative or not finite (inside ``tf.function``:
                ``InvalidArgumentError`` when the step runs, before any state
                changes).
            TypeError: ``weight`` is not a number; ``decay_var_list`` is given
                and the inner optimizer's ``apply_gradients`` does not take it.
        """
        weight = self._micro_step_weight(weight)
        grads_and_vars = list(grads_and_vars)
        if decay_var_list is not None:
            self._window.context["inner_kwargs"] = {
                "decay_var_list": _decay_var_list(self.inner_optimizer, decay_var_list)}
        elif self._window.context.get("inner_kwargs"):
            self._window.context["inner_kwargs"] = {}
        if not grads_and_vars:
            return None
        grads, variables = zip(*grads_and_vars)
        self._window.context["aggregate"] = bool(experimental_aggregate_gradients)
        return self._take_micro_step(grads, variables, weight, name)

    @_tf_route.unconverted
    def minimize(self, loss: Any, var_list: Any, grad_loss: Any = None, name: str | None = None,
                 tape: Any = None, weight: Any = None, decay_var_list: Sequence[Any] | None = None) -> Any:
        """One micro-step on the gradients of ``loss``: ``OptimizerV2.minimize``
        (``loss`` a callable, or a tensor with the ``tape`` that recorded it),
        then :meth:`apply_gradients` with ``weight`` and ``decay_var_list``.

        Returns:
            What :meth:`apply_gradients` returns.
        """
        grads_and_vars = compat.legacy_compute_gradients(self, loss, var_list, grad_loss, tape)
        return self.apply_gradients(grads_and_vars, name=name, weight=weight, decay_var_list=decay_var_list)

    def _update_inner(self, grads: list, variables: list) -> Any:
        kwargs = dict(self._window.context.get("inner_kwargs") or {})
        if not self._window.context.get("aggregate", True):
            kwargs["experimental_aggregate_gradients"] = False
        return self.inner_optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, variables) if g is not None], **kwargs
        )

    def _install_gates(self, gates: dict) -> Any:
        return compat.install_legacy_gates(self.inner_optimizer, self._build_order, gates, self._keras)

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": super().get_config()["name"],
            "inner_optimizer": self._keras.optimizers.serialize(self.inner_optimizer),
            "gradient_accumulation_steps": _accumulating.serialize_schedule(self._keras, self.gradient_accumulation_steps),
            "reduction": self.reduction,
            **self._numerics_config(),
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        config = dict(config)
        inner = config.pop("inner_optimizer")
        if isinstance(inner, dict):
            # By its registered name (tfa's "Addons>AdamW"), which the .h5
            # loader would not look up; a copy (deserialize edits it in place).
            inner = cls._keras.optimizers.deserialize(
                _keras2.by_registered_name(cls._keras, inner, custom_objects), custom_objects=custom_objects,
                use_legacy_optimizer=True,
            )
        config = _accumulating.deserialize_schedule(cls._keras, config, custom_objects)
        return cls(inner, **config)


def _decay_var_list(inner: Any, decay_var_list: Any) -> list:
    """``decay_var_list`` checked against ``inner``'s ``apply_gradients``."""
    try:
        takes = "decay_var_list" in inspect.signature(inner.apply_gradients).parameters
    except (TypeError, ValueError):
        takes = True
    if not takes:
        raise TypeError(
            "`decay_var_list` is an argument of tensorflow-addons' decoupled weight decay optimizers "
            "(tfa.optimizers.AdamW, SGDW, extend_with_decoupled_weight_decay); the inner optimizer "
            f"{type(inner).__module__}.{type(inner).__qualname__} does not take it. Received: "
            f"decay_var_list={decay_var_list!r}."
        )
    return list(decay_var_list)


def _unknown_position(shape: Any, dtype: Any = tf.int64, **kwargs: Any) -> Any:
    """Initializer of ``mini_step``: :data:`accum_optimizer.core.UNKNOWN_POSITION`."""
    return tf.fill(shape, tf.constant(core.UNKNOWN_POSITION, dtype))


wrapper_class = _keras2.wrapper_classes(
    (_LegacyAccumulating,), _base_of, "LegacyAccumulatingOptimizer", __name__, _LegacyAccumulating.__doc__
)
"""``wrapper_class(package)``: the ``AccumulatingOptimizer`` class for a
Keras 2 package (``keras`` 2.x or ``tf_keras``): a subclass of its
``optimizers.legacy.Optimizer``, registered as
``"accum_optimizer>LegacyAccumulatingOptimizer"``."""

#: The wrapper class of the primary Keras 2 package.
AccumulatingOptimizer = wrapper_class(_keras2.primary_package("legacy"))
