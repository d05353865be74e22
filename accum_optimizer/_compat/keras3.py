"""Keras 3's private symbols used by the Keras 3 family, each declared once.

Every function here is the one place its private symbol is touched; the
``Private`` records (see :mod:`accum_optimizer._compat`) say why, and on
which versions it was checked. Checked on Keras 3.15.0 (TF 2.16.2) and
3.15.1 (TF 2.21).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Sequence

import keras

from accum_optimizer._compat import model_up_the_stack, private, require

if not str(keras.__version__).startswith("3."):  # Keras 2.x is `keras` on TF <= 2.15
    raise ImportError(f"{__name__} needs Keras 3; `import keras` is Keras {keras.__version__} here.")

CHECKED = "Keras 3.15.0 (TF 2.16.2), 3.15.1 (TF 2.21)"

VAR_KEY = private(
    "keras.optimizers.Optimizer._var_key",
    "keras",
    "the key by which Keras indexes an optimizer's per-variable state; on TF it unwraps the "
    "tf.distribute container of a replica's component, which no public API does",
    CHECKED,
    lambda k: k.optimizers.Optimizer._var_key,
)


def var_key(optimizer: Any, variable: Any) -> Any:
    """The key ``optimizer`` indexes ``variable``'s state by."""
    return require(VAR_KEY, keras)(optimizer, variable)


TRACK_VARIABLE = private(
    "keras.optimizers.Optimizer._track_variable",
    "keras",
    "Keras lists an optimizer's variables in the order it tracks them: what `variables` returns, "
    "what tf.train.Checkpoint saves by position; replica-local variables are made with "
    "keras.Variable (add_variable takes no `synchronization`) and must be tracked by hand, also "
    "inside LossScaleOptimizer.build, which turns automatic tracking off",
    CHECKED,
    lambda k: k.optimizers.Optimizer._track_variable,
)


def track_variable(optimizer: Any, variable: Any) -> Any:
    """Add ``variable`` to ``optimizer``'s variables (in order); return it."""
    require(TRACK_VARIABLE, keras)(optimizer, variable)
    return variable


REDUCE_WEIGHTED_VALUES = private(
    "keras.src.losses.loss.reduce_weighted_values (and apply_mask, squeeze_or_expand_to_same_rank)",
    "keras",
    "CountedLoss computes the loss exactly as keras.losses.Loss.__call__ does, and the count "
    "its mean divides by, with Keras' own mask and sample-weight helpers (not exported)",
    CHECKED,
    lambda k: _loss_module().reduce_weighted_values
    and _loss_module().apply_mask
    and _loss_module().squeeze_or_expand_to_same_rank,
)


def _loss_module() -> Any:
    from keras.src.losses import loss  # private: see REDUCE_WEIGHTED_VALUES

    return loss


def loss_helpers() -> Any:
    """``keras.src.losses.loss``: ``reduce_weighted_values``, ``apply_mask``,
    ``squeeze_or_expand_to_same_rank``."""
    require(REDUCE_WEIGHTED_VALUES, keras)
    return _loss_module()


LOSS_FUNCTION_WRAPPER = private(
    "keras.src.losses.losses.LossFunctionWrapper",
    "keras",
    "CountedLoss turns a loss function into a keras.losses.Loss the way keras.losses.get does "
    "(the class is not exported)",
    CHECKED,
    lambda k: __import__("keras.src.losses.losses", fromlist=["LossFunctionWrapper"]).LossFunctionWrapper,
)


def loss_function_wrapper() -> type:
    return require(LOSS_FUNCTION_WRAPPER, keras)


KERAS_MASK = private(
    "keras.src.backend.common.masking.get_keras_mask",
    "keras",
    "CountedLoss merges the prediction's and the losses' masks as keras.losses.Loss.__call__ "
    "does; Keras keeps a tensor's mask in a private attribute and exports no reader",
    CHECKED,
    lambda k: __import__("keras.src.backend.common.masking", fromlist=["get_keras_mask"]).get_keras_mask,
)


def keras_mask(x: Any) -> Any:
    """The Keras mask a tensor carries (``None`` if none)."""
    return require(KERAS_MASK, keras)(x)


MOVING_AVERAGE = private(
    "keras.optimizers.Optimizer._model_variables_moving_average and _trainable_variables",
    "keras",
    "keras.callbacks.SwapEMAWeights reads them on the optimizer it is given (unwrapping one "
    "LossScaleOptimizer): the wrapper answers with its inner optimizer's EMA variables and "
    "trained variables",
    CHECKED,
    lambda k: _reads(_reads(k.callbacks.SwapEMAWeights, "_model_variables_moving_average"), "_trainable_variables"),
)


def _reads(obj: Any, name: str) -> Any:
    """``obj`` if its source mentions ``name`` (else ``KeyError``)."""
    import inspect

    if name not in inspect.getsource(obj):
        raise KeyError(f"{obj.__qualname__} no longer reads {name}")
    return obj

class KerasReads:
    """Mixin: the private attributes Keras' own code reads on whatever
    optimizer it is given (``SwapEMAWeights``, see :data:`MOVING_AVERAGE`),
    answered by the wrapper's inner optimizer."""

    @property
    def _model_variables_moving_average(self) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            raise AttributeError("_model_variables_moving_average")
        require(MOVING_AVERAGE, keras)
        return inner._model_variables_moving_average

    @property
    def _trainable_variables(self) -> list:
        inner = self.__dict__.get("inner_optimizer")
        return [] if inner is None else inner._trainable_variables

    @_trainable_variables.setter
    def _trainable_variables(self, value: Any) -> None:
        pass  # Keras' base __init__ sets [] before the inner optimizer exists


# ------------------------------------------------ a LossScaleOptimizer outside
FRAME_WALK = private(
    "sys._getframe (the LossScaleOptimizer building this optimizer)",
    "keras",
    "keras.optimizers.LossScaleOptimizer.build calls inner_optimizer.build and nothing tells the "
    "inner optimizer about its outer one (compile creates it under 'mixed_float16'); its state is "
    "saved with the wrapper's and a skipping nonfinite policy must learn of the micro-steps it skips",
    CHECKED,
    lambda k: sys._getframe and k.optimizers.LossScaleOptimizer.build,
)


def outer_loss_scale_optimizer(wrapper: Any) -> Any:
    """The ``keras.optimizers.LossScaleOptimizer`` whose ``inner_optimizer``
    is ``wrapper`` and which is building it now (a frame up the stack), or
    ``None``. Looked up once per build."""
    require(FRAME_WALK, keras)
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


NON_FINITE_BRANCH = private(
    "keras.optimizers.LossScaleOptimizer._stateful_handle_non_finite_grads (replaced on the instance)",
    "keras",
    "where the LossScaleOptimizer skips a non-finite micro-step without calling the inner apply; "
    "both its single-device and its merge_call paths look it up on the instance, so a wrapper "
    "there records the skipped micro-step (nonfinite='skip_micro_step'/'skip_window')",
    CHECKED,
    lambda k: k.optimizers.LossScaleOptimizer._stateful_handle_non_finite_grads,
)


def _hook(outer: Any, owner: Any, record: Any, attribute: str, wrap: Callable[[Callable, Any], Callable]) -> None:
    """Replace ``outer``'s method ``attribute`` (the private symbol of
    ``record``) on the instance by ``wrap(original, weakref to owner)``,
    once per ``owner`` (hooking twice is a no-op)."""
    require(record, keras)
    original = getattr(outer, attribute)
    if getattr(original, "_accumulating_optimizer", None) is owner:
        return
    hooked = wrap(original, weakref.ref(owner))
    hooked._accumulating_optimizer = owner
    object.__setattr__(outer, attribute, hooked)


def hook_non_finite_branch(outer: Any, owner: Any, on_skip: Callable[[], None]) -> None:
    """Make ``outer``'s non-finite branch also call ``on_skip`` (once per
    ``owner``: hooking twice is a no-op).

    Raises:
        PrivateSymbolMissing: this Keras has no such branch.
    """

    def wrap(original: Callable, owner_ref: Any) -> Callable:
        def handle_non_finite_grads(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if owner_ref() is not None:
                on_skip()
            return result

        return handle_non_finite_grads

    _hook(outer, owner, NON_FINITE_BRANCH, "_stateful_handle_non_finite_grads", wrap)


STATELESS_NON_FINITE_BRANCH = private(
    "keras.optimizers.LossScaleOptimizer._stateless_handle_non_finite_grads (replaced on the instance)",
    "keras",
    "where LossScaleOptimizer.stateless_apply (JAX) skips a non-finite micro-step without calling the "
    "inner stateless_apply; a wrapper there records the skipped micro-step in the state it returns "
    "(nonfinite='skip_micro_step'/'skip_window')",
    CHECKED + ", 3.15.1 (JAX 0.10.2)",
    lambda k: k.optimizers.LossScaleOptimizer._stateless_handle_non_finite_grads,
)


def hook_stateless_non_finite_branch(outer: Any, owner: Any, on_skip: Callable[[], None]) -> None:
    """Make ``outer``'s stateless non-finite branch (``stateless_apply``, JAX)
    also run ``on_skip`` (once per ``owner``) on the state it returns: in a
    ``keras.StatelessScope`` over ``outer``'s variables and the trainable
    variables ``owner`` was built with, whose new values it returns instead.

    Raises:
        PrivateSymbolMissing: this Keras has no such branch.
    """

    def wrap(original: Callable, owner_ref: Any) -> Callable:
        def handle_non_finite_grads(optimizer_variables: Any, trainable_variables: Any) -> Any:
            trainable, variables = original(optimizer_variables, trainable_variables)
            inner = owner_ref()
            if inner is None:
                return trainable, variables
            outer_variables, order = list(outer.variables), list(inner._build_order)
            mapping = list(zip(outer_variables, variables)) + list(zip(order, trainable))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                on_skip()
            return ([scope.get_current_value(v) for v in order],
                    [scope.get_current_value(v) for v in outer_variables])

        return handle_non_finite_grads

    _hook(outer, owner, STATELESS_NON_FINITE_BRANCH, "_stateless_handle_non_finite_grads", wrap)


SCALE_LOSS = private(
    "keras.optimizers.LossScaleOptimizer.scale_loss (replaced on the instance)",
    "keras",
    "LossScaleOptimizer.scale_loss multiplies by its own scale and does not call its inner optimizer's: "
    "under float8 training a wrapper inside also divides the micro-batch loss by N there, so that the "
    "output-gradient amax history is the large batch's (docs/mixed-precision.md#float8)",
    CHECKED,
    lambda k: k.optimizers.LossScaleOptimizer.scale_loss,
)


def hook_scale_loss(outer: Any, owner: Any, then: Callable[[Any], Any]) -> None:
    """Make ``outer.scale_loss(loss)`` return ``then(outer's own result)``
    (once per ``owner``: hooking twice is a no-op).

    Raises:
        PrivateSymbolMissing: this Keras has no such method.
    """

    def wrap(original: Callable, owner_ref: Any) -> Callable:
        def scale_loss(loss: Any) -> Any:
            scaled = original(loss)
            return scaled if owner_ref() is None else then(scaled)

        return scale_loss

    _hook(outer, owner, SCALE_LOSS, "scale_loss", wrap)


# --------------------------------------------------------------- gating
APPLY_WEIGHT_DECAY = private(
    "keras.optimizers.Optimizer._apply_weight_decay and update_step (replaced on the instance "
    "during one traced update), keras.Variable.constraint (replaced during one traced update)",
    "keras",
    "a variable without a gradient in the window must get no update, weight decay or constraint, "
    "as in the large batch, but which variables had none is known only when the step runs: their "
    "per-variable mutations run under a cond on that; Keras applies weight decay to the variables "
    "passed to apply, and has no per-variable public hook",
    CHECKED,
    lambda k: k.optimizers.Optimizer._apply_weight_decay and k.optimizers.Optimizer.update_step,
)


def optimizer_tree(optimizer: Any) -> list:
    """``optimizer`` and the optimizers it delegates updates to (``MultiOptimizer``)."""
    found = [optimizer]
    for sub in getattr(optimizer, "optimizers", None) or []:
        found += optimizer_tree(sub)
    return found


def install_gates(inner: Any, variables: Sequence[Any], gates: dict, cond: Any = None) -> Callable[[], None]:
    """Run the per-variable mutations of ``inner`` (and the optimizers it
    delegates to) on each variable in ``gates`` (index in ``variables`` ->
    boolean scalar) under ``cond`` on its gate (``keras.ops.cond`` by
    default; on JAX a ``cond`` whose branches may write variables):
    ``update_step``, weight decay and the variable's constraint. Returns the
    function that undoes it."""
    require(APPLY_WEIGHT_DECAY, keras)
    cond = cond or keras.ops.cond
    patched = []
    for opt in optimizer_tree(inner):
        keyed = {var_key(opt, variables[i]): g for i, g in gates.items()}
        by_key = {var_key(opt, variables[i]): variables[i] for i in gates}
        patched.append(opt)
        object.__setattr__(opt, "update_step", _gated_update_step(opt, keyed, by_key, cond))
        object.__setattr__(opt, "_apply_weight_decay", _gated_weight_decay(opt, keyed))
    constrained = []
    for i, gate in gates.items():
        v = variables[i]
        c = getattr(v, "constraint", None)
        if c is not None:
            constrained.append((v, c))
            v.constraint = _GatedConstraint(gate, c)

    def remove() -> None:
        for opt in patched:
            object.__delattr__(opt, "update_step")
            object.__delattr__(opt, "_apply_weight_decay")
        for v, c in constrained:
            v.constraint = c

    return remove


class _GatedConstraint(keras.constraints.Constraint):
    """``constraint(x)`` if ``gate`` holds, else ``x`` (a ``Constraint``
    instance: Keras 3.10 to 3.14 accept nothing else)."""

    def __init__(self, gate: Any, constraint: Callable[[Any], Any]) -> None:
        self.gate, self.constraint = gate, constraint

    def __call__(self, x: Any) -> Any:
        return keras.ops.cond(self.gate, lambda: self.constraint(x), lambda: x)


USE_WEIGHT_DECAY = private(
    "keras.optimizers.Optimizer._use_weight_decay",
    "keras",
    "a gated variable's weight decay runs under the cond of its gate, beside its update step "
    "(the TF backend's _apply_weight_decay enters merge_call, which a cond in replica context "
    "refuses under MirroredStrategy); whether Keras decays the variable "
    "(exclude_from_weight_decay) is Keras' own decision",
    CHECKED,
    lambda k: k.optimizers.Optimizer._use_weight_decay,
)


def decay_one(opt: Any, variable: Any, component: Any) -> None:
    """Keras' weight decay of ``variable`` (``component`` is the tensor
    written: the variable, or its replica's copy inside a strategy's update):
    ``v - v * weight_decay * learning_rate``, the formula of every Keras 3
    backend's ``_apply_weight_decay`` (``keras/src/optimizers/base_optimizer.py``)."""
    if opt.weight_decay is None or not require(USE_WEIGHT_DECAY, keras)(opt, variable):
        return
    lr = keras.ops.cast(opt.learning_rate, component.dtype)
    wd = keras.ops.cast(opt.weight_decay, component.dtype)
    opt.assign(component, component - component * wd * lr)


def _gated_update_step(opt: Any, gates: dict, variables: dict, cond: Callable) -> Callable:
    orig = opt.update_step

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        key = var_key(opt, variable)
        gate = gates.get(key)
        if gate is None:
            return orig(gradient, variable, learning_rate)

        def update() -> None:
            # Keras decays every variable, then updates each: per variable
            # the same two writes in the same order (weight decay first).
            decay_one(opt, variables[key], variable)
            orig(gradient, variable, learning_rate)

        return cond(gate, update, lambda: None)

    return update_step


def _gated_weight_decay(opt: Any, gates: dict) -> Callable:
    """Weight decay of the ungated variables only; the gated ones decay in
    their gated update step (``_gated_update_step``)."""
    orig = opt._apply_weight_decay

    def apply_weight_decay(variables: Any) -> None:
        ungated = [v for v in variables if var_key(opt, v) not in gates]
        if ungated:  # (torch's refuses an empty list: torch._foreach_mul_)
            orig(ungated)

    return apply_weight_decay


# --------------------------------------------------------------- saving
SAVING_WALK = private(
    "keras.saving (keras/src/saving/saving_lib.py) walks dir(optimizer) for child objects to save",
    "keras",
    "the inner optimizer's variables are saved with the wrapper's own (restored together, "
    "deferred until build): it is left out of dir() so that Keras does not save it a second "
    "time, and the outer LossScaleOptimizer (a parent, not a child) so that the walk ends",
    CHECKED,
    lambda k: k.saving.save_model and k.saving.load_model,
)


def hidden_from_saving_walk(names: Sequence[str]) -> list:
    """``dir()`` of a wrapper without the attributes Keras' saving walk must
    not follow (see :data:`SAVING_WALK`)."""
    return [a for a in names if a not in ("inner_optimizer", "outer_optimizer")]



MODEL_BEING_LOADED = private(
    "sys._getframe (the model whose weights keras.saving is loading)",
    "keras",
    "model.load_weights calls optimizer.load_own_variables(store) and nothing tells the optimizer "
    "its model: one not built yet is built with that model's trainable variables, as Keras' first "
    "train step would, so that the state is restored at load, not kept aside until the first step",
    CHECKED,
    lambda k: sys._getframe and k.Model.load_weights,
)


def model_being_loaded(optimizer: Any) -> Any:
    """The built ``keras.Model`` whose weights are being loaded, with
    ``optimizer`` (or a ``LossScaleOptimizer`` around it) as its optimizer,
    or ``None``."""
    require(MODEL_BEING_LOADED, keras)
    return model_up_the_stack(optimizer, keras.Model)


BATCH_NORM_MOMENTS = private(
    "keras.layers.BatchNormalization._moments",
    "keras",
    "accum_optimizer.layers.BatchNormalization normalises a micro-batch by the moments its parent "
    "computes (masks and synchronized=True included) and pools them; the parent computes them inside "
    "call() next to its own moving-statistics update and exports no other route",
    CHECKED,
    lambda k: k.layers.BatchNormalization._moments,
)


def batch_norm_moments(layer: Any, inputs: Any, mask: Any) -> tuple:
    """``(mean, variance)`` of ``inputs`` as ``layer``'s Keras
    ``BatchNormalization.call`` computes them in training."""
    return require(BATCH_NORM_MOMENTS, keras)(layer, inputs, mask)
