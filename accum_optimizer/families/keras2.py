"""`AccumulatingOptimizer` for the Keras 2 new optimizer API.

The Keras 2 *new* optimizer API is ``tf.keras.optimizers.Optimizer`` on
TF 2.11-2.15 (Keras 2.15) and ``tf_keras.optimizers.Optimizer`` (TF >= 2.16,
with ``TF_USE_LEGACY_KERAS=1`` or imported directly): Keras 3's ancestor,
with ``build``, ``apply_gradients``, ``update_step``, EMA, ``iterations`` and
a distributed apply in one ``merge_call``. The legacy ``OptimizerV2``
classes (``tf.keras.optimizers.legacy``) are another family.

The wrapper subclasses the ``Optimizer`` of the inner optimizer's own
package: :func:`wrapper_class` builds one class per package
(:mod:`~accum_optimizer.families._keras2`), registered as
``"accum_optimizer>AccumulatingOptimizer"``. The module-level
:data:`AccumulatingOptimizer` is the class of the active ``tf.keras`` when
that is Keras 2, else of the imported ``tf_keras``. What it shares with the
other ``tf.function`` families is :mod:`~accum_optimizer.families._tf_route`.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from accum_optimizer import _args
from accum_optimizer.core import layout
from accum_optimizer._compat import keras2 as compat
from accum_optimizer.families import _accumulating, _keras2, _tf_route

# `weight_decay` defaults to 0 in Keras 2's `Optimizer`, to None in its subclasses.
_INNER_ONLY_ARGS = {
    **_args.KERAS_OPTIMIZER_ARGUMENTS, "weight_decay": 0, "jit_compile": True, "mesh": None,
    "is_legacy_optimizer": False,
}

_ON_READ = tf.VariableSynchronization.ON_READ


def _base_of(package: Any) -> Any:
    return package.optimizers.Optimizer


class _Keras2Accumulating(compat.NewOptimizerHooks, _keras2.PerPackage, _tf_route.TFRoute):
    """Accumulate gradients over micro-batches, update once per window (Keras 2).

    Each call to :meth:`apply_gradients` (or ``minimize``, which ``fit``
    uses) is one *micro-step*: the gradients are added into accumulator
    slots. On every ``gradient_accumulation_steps``-th micro-step the inner
    optimizer's ``apply_gradients`` is called once with the window's gradient
    and the slots are zeroed. Between updates the model weights and all of
    the inner optimizer's state (slots, ``iterations``, EMA, the current
    learning rate of a schedule) stay bitwise untouched. The arguments and
    semantics are the Keras 3 family's
    (:class:`accum_optimizer.families.keras3.AccumulatingOptimizer`), with
    these differences:

    * ``inner_optimizer``: a Keras 2 new-API optimizer
      (``tf.keras.optimizers.Adam()`` where ``tf.keras`` is Keras 2, or
      ``tf_keras.optimizers.Adam()``), or an identifier that this package's
      ``optimizers.get`` resolves (``"adam"``). A callable schedule of N must
      be registered with this package's ``register_keras_serializable`` for
      ``get_config``.
    * ``nonfinite`` and ``accumulator_dtype`` as in Keras 3 (the policies
      keep ``skipped_micro_steps``, ``skipped_windows`` and, for
      ``"skip_window"``, ``window_poisoned``; a 16-bit variable's
      ``true_dtype`` picks the default float32 accumulator). With a
      ``LossScaleOptimizer`` outside, a micro-step it skips never reaches this
      optimizer (it is neither counted nor discards its window: Keras 2's
      ``LossScaleOptimizer`` has no channel to tell it).
    * ``mini_step`` is -1 ("unknown") until the first micro-step or
      :meth:`flush`, which derive it from ``micro_steps``: state saved before
      it existed resumes exactly. ``mini_step`` and ``window_weight`` come
      last in :attr:`variables`, after the inner optimizer's.
    * ``lr`` (what Keras 2's ``LearningRateScheduler`` and
      ``ReduceLROnPlateau`` read and assign) forwards to the inner optimizer,
      as do its clip settings, EMA and weight decay settings and
      hyperparameters (``opt.beta_1``, ``opt.epsilon``: read and assigned)
      and public methods the wrapper lacks (never an update:
      :class:`accum_optimizer._compat.ForwardsSettings`).
    * A variable with no gradient in the whole window gets no update, weight
      decay, EMA update or constraint, as Keras 2 leaves a variable whose
      gradient is ``None`` in the large batch. Sparse gradients are
      scatter-added and the update hands the dense window gradient to the
      inner optimizer (every Keras 2 new-API optimizer gives an untouched
      row the same update for a zero row of a dense gradient as for a row
      absent from an ``IndexedSlices`` one, so the result matches the
      sparse large batch).

    State (``tf.Variable`` s, saved wherever Keras 2 saves optimizer state,
    in :attr:`variables` order): ``micro_steps``, ``grad_received``,
    ``acc_grads``, the skip counters (skipping policies only), the inner
    optimizer's variables (``iterations`` first), ``mini_step``,
    ``window_weight``.

    Raises:
        TypeError, ValueError: as the Keras 3 family's, for arguments
            (:class:`accum_optimizer._args.Constructor`).
    """

    _FAMILY = "Keras 2 new API"
    _INNER_ONLY = _INNER_ONLY_ARGS
    _KIND, _API = "Keras 2 optimizer", "optimizers"

    @staticmethod
    def _resolve(package: Any, identifier: Any) -> Any:
        return _deserialize(package, identifier)

    def _base_arguments(self, args: _args.Arguments) -> dict:
        return {"name": args.name or "AccumulatingOptimizer", "jit_compile": False}

    def _init_state(self, args: _args.Arguments) -> None:
        self.inner_optimizer = args.inner
        self.reduction = args.reduction
        self._keep_numerics(args)
        self._remember_strategy()
        # The optional trailing block of the saved layout (see `variables`).
        self._window.blocks = {"window": []}

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the accumulator slots, the counters and the inner's variables.

        Runs in ``tf.init_scope`` (eagerly, outside any traced function), as
        Keras 2's ``apply_gradients`` builds. Idempotent.
        """
        if self._window_built():
            return
        var_list = list(var_list)
        self._check_strategy_at_build()
        with tf.init_scope():
            with tf.name_scope(self.name):
                self.mini_step = self.window_weight = self.grad_received = None
                # (`mini_step` starts "unknown": the first micro-step or flush
                # derives it, so that a checkpoint saved without it resumes.)
                _accumulating.make_window(self, var_list, self._make_state)
            # Named as the plain inner optimizer names its variables.
            with tf.name_scope(self.inner_optimizer.name):
                self.inner_optimizer.build(var_list)
        self._set_build_order(var_list)
        self._link_followers(var_list)
        compat.mark_built(self)
        state = self._window.take_deferred()
        if state is not None:
            with tf.init_scope():
                self.load_own_variables(state)

    def _key_of(self, variable: Any) -> Any:
        return compat.var_key(self, variable)

    def _make_state(self, spec: layout.Spec, variable: Any) -> tf.Variable:
        """One variable of the window (:func:`~accum_optimizer.families._accumulating.make_window`); those of the
        optional blocks are not among the wrapper's own (``_variables``)."""
        if spec.name == "acc_grad":
            return self._accumulator(variable)
        if spec.replica_local:  # window_weight
            return tf.Variable(tf.zeros(spec.shape, spec.dtype), trainable=False, name=spec.name,
                               synchronization=_ON_READ, aggregation=tf.VariableAggregation.SUM)
        initial = tf.fill(spec.shape, tf.constant(spec.initial, tf.int64))
        return self._counter(initial, spec.name, keep=spec.block == "own")

    def _counter(self, initial_value: Any, name: str, keep: bool = True) -> tf.Variable:
        variable = tf.Variable(
            initial_value, trainable=False, name=name, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
        if keep:
            compat.track_variable(self, variable)
        return variable

    def _accumulator(self, reference: Any) -> tf.Variable:
        """One slot per trainable variable: a replica-local (``ON_READ``,
        summed on read) zero-initialised variable of its shape, in the
        accumulator dtype (float32 for a 16-bit variable by default)."""
        dtype = self._accumulator_dtype(reference)
        with _tf_route.colocated_with(self, reference):
            variable = tf.Variable(
                tf.zeros(reference.shape, dtype), trainable=False,
                name=f"acc_grad/{reference.name.split(':')[0]}",
                synchronization=_ON_READ, aggregation=tf.VariableAggregation.SUM,
            )
        compat.track_variable(self, variable)
        return variable

    @property
    def variables(self) -> list:
        """The wrapper's variables (``micro_steps``, ``grad_received``,
        ``acc_grads``), all of the inner optimizer's, then ``mini_step`` and
        ``window_weight`` (a ``CallableList``, as Keras 2 returns)."""
        return compat.callable_list(
            self._keras,
            self._saved_variables(),
        )

    _LAYOUT_NAME = "keras2"
    _LAYOUT = layout.LAYOUTS["keras2"]

    def _saved_blocks(self) -> dict:
        return {"own": compat.own_variables(self), "inner": list(self.inner_optimizer.variables),
                **self._window.blocks}

    def __dir__(self) -> list:
        # The `.keras` format walks `dir()` for child objects to save; the
        # inner optimizer's variables are already in this optimizer's
        # `variables` (saved and restored together).
        return [a for a in super().__dir__() if a != "inner_optimizer"]

    # Owned by the inner optimizer, which applies them once per update
    # (clipping: :class:`~accum_optimizer.families._keras2.PerPackage`).
    use_ema = _args.forwarded("use_ema")
    ema_momentum = _args.forwarded("ema_momentum")
    ema_overwrite_frequency = _args.forwarded("ema_overwrite_frequency")
    weight_decay = _args.forwarded("weight_decay")

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Forwarded to the inner optimizer, which owns the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Forwarded: the inner optimizer's EMA overwrite at the end of ``fit``."""
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------- saving
    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`variables`).

        Weights saved before ``mini_step`` and ``window_weight`` existed
        (0.2.0.dev0 and older: all but those two) are accepted; the window's
        position is then ``micro_steps % N`` again.

        Raises:
            ValueError: the optimizer is not built, or the number or shapes of
                ``weights`` do not match :attr:`variables`.
        """
        if not self._window_built():
            raise ValueError(
                "set_weights() needs a built optimizer; call "
                "`optimizer.build(trainable_variables)` first."
            )
        self._restore(list(weights), self.name)

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """Restore state saved by ``save_own_variables`` (the ``.keras`` and
        ``.weights.h5`` formats).

        On an optimizer that is not built yet, loaded through its model
        (``model.load_weights``), the optimizer is built first with the
        model's trainable variables and the state restored at once; called
        directly, with no model, the values are kept and restored by
        :meth:`build`. (Keras 2 itself would skip them with a warning.) An
        empty store (weights saved without optimizer state)
        restores nothing.

        Raises:
            ValueError: the number of saved variables does not match.
        """
        if len(store.keys()) == 0 or not self._ready_to_restore(store):  # (no model: restored when it builds)
            return
        self._restore([np.asarray(store[str(i)]) for i in range(len(store.keys()))], self.name)

    def _model_being_loaded(self) -> Any:
        return compat.model_being_loaded(self, self._keras)

    # ------------------------------------------------------------ micro-step
    @_tf_route.unconverted
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

        ``weight``: the micro-batch's count, as in the Keras 3 family's
        :meth:`~accum_optimizer.families.keras3.AccumulatingOptimizer.apply`;
        ``None``: the count a ``CountedLoss`` reported in this train step
        (``fit``), if any, else 1.

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
        weight = self._micro_step_weight(weight)
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, variables = zip(*grads_and_vars)
        self._window.context["skip_aggregation"] = skip_gradients_aggregation or not aggregate
        with tf.name_scope(name or self.name):
            self._take_micro_step(grads, variables, weight)
        return self.iterations

    def _update_inner(self, grads: list, variables: list) -> Any:
        return self.inner_optimizer.apply_gradients(
            zip(grads, variables), skip_gradients_aggregation=self._window.context.get("skip_aggregation", False)
        )

    def _install_gates(self, gates: dict) -> Any:
        return compat.install_new_api_gates(self.inner_optimizer, self._build_order, gates, self._keras)

    # ---------------------------------------------------------- serialization
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": self._keras.optimizers.serialize(self.inner_optimizer),
            "gradient_accumulation_steps": _accumulating.serialize_schedule(self._keras, self.gradient_accumulation_steps),
            "reduction": self.reduction,
            **self._numerics_config(),
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
        config = _accumulating.deserialize_schedule(cls._keras, config, custom_objects)
        return cls(inner, **config)


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


wrapper_class = _keras2.wrapper_classes(
    (_Keras2Accumulating,), _base_of, "AccumulatingOptimizer", __name__, _Keras2Accumulating.__doc__
)
"""``wrapper_class(package)``: the ``AccumulatingOptimizer`` class for one
Keras 2 package (``tf_keras`` or ``keras`` 2.x), a subclass of its
``optimizers.Optimizer`` registered as ``"accum_optimizer>AccumulatingOptimizer"``."""

AccumulatingOptimizer = wrapper_class(_keras2.primary_package("keras2"))
