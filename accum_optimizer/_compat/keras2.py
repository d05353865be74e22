"""Keras 2's private symbols used by the Keras 2 and legacy families.

Keras 2 is ``tf_keras`` (TF >= 2.16) or the ``keras`` 2.x of TF <= 2.15;
each function takes the package (module) its optimizer belongs to. Checked
on tf_keras 2.21 (TF 2.21) and Keras 2.15 (TF 2.15.1, tensorflow-addons
0.23).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer._compat import attributes, model_up_the_stack, private, require
from accum_optimizer._compat import tf as tf_compat

CHECKED = "tf_keras 2.21 (TF 2.21), Keras 2.15 (TF 2.15.1)"


def _module_of(cls: type) -> Any:
    return sys.modules[cls.__module__]


# ----------------------------------------------------- the new optimizer API
BASE_WEIGHT_DECAY = private(
    "<keras2>.optimizers.optimizer._BaseOptimizer._apply_weight_decay",
    "tf_keras",
    "Keras 2's per-variable weight decay, without the merge_call of its distributed subclass: "
    "what the gated weight decay of a variable without a gradient runs per device",
    CHECKED,
    lambda p: _module_of(p.optimizers.Optimizer)._BaseOptimizer._apply_weight_decay,
)

CALLABLE_LIST = private(
    "<keras2>.optimizers.optimizer.CallableList",
    "tf_keras",
    "what Keras 2's Optimizer.variables returns (a list that can also be called, as old code "
    "does): the wrapper's `variables` returns the same type",
    CHECKED,
    lambda p: _module_of(p.optimizers.Optimizer).CallableList,
)

OPTIMIZER_STATE = private(
    "<keras2>.optimizers.Optimizer._var_key, _variables, _built, _create_iteration_variable, "
    "_distribution_strategy",
    "tf_keras",
    "the key Keras 2 indexes per-variable state by (it unwraps tf.distribute containers); the "
    "list an optimizer's variables live in, saved in checkpoints under that name; the flag Keras 2 "
    "reads to know they exist; the hook that creates `iterations` (the wrapper has none of its "
    "own: its iterations are the inner optimizer's); the strategy the optimizer applies under",
    CHECKED,
    lambda p: attributes(p.optimizers.Optimizer, "_var_key", "_create_iteration_variable"),
)


def var_key(optimizer: Any, variable: Any) -> Any:
    """The key Keras 2's ``optimizer`` indexes ``variable``'s state by."""
    require(OPTIMIZER_STATE, _package_of(optimizer))
    return optimizer._var_key(variable)


def track_variable(optimizer: Any, variable: Any) -> None:
    """List ``variable`` among ``optimizer``'s own (``_variables``: what Keras
    2 saves under that name in a checkpoint, in order)."""
    optimizer._variables.append(variable)


def own_variables(optimizer: Any) -> list:
    """``optimizer``'s own variables (``_variables``), in order."""
    return list(optimizer._variables)


def mark_built(optimizer: Any) -> None:
    """Tell Keras 2 that ``optimizer``'s variables exist (its ``_built``)."""
    optimizer._built = True


def callable_list(package: Any, values: Sequence[Any]) -> list:
    return require(CALLABLE_LIST, package)(list(values))


def _package_of(optimizer: Any) -> Any:
    """The Keras 2 package ``optimizer``'s class comes from."""
    for cls in type(optimizer).__mro__:
        top = sys.modules.get(cls.__module__.split(".")[0])
        if top is not None and top.__name__ in ("tf_keras", "keras") and str(getattr(top, "__version__", "")).startswith("2."):
            return top
    return sys.modules.get("tf_keras") or sys.modules.get("keras")


MODEL_BEING_LOADED = private(
    "sys._getframe (the model whose weights <keras2>.saving is loading)",
    "tf_keras",
    "model.load_weights (.weights.h5, .keras) calls optimizer.load_own_variables(store) and nothing "
    "tells the optimizer its model: one not built yet is built with that model's trainable "
    "variables, as the first train step would, so that the state is restored at load",
    CHECKED,
    lambda p: sys._getframe and p.Model.load_weights,
)


def model_being_loaded(optimizer: Any, package: Any) -> Any:
    """The built ``package.Model`` whose weights are being loaded, with
    ``optimizer`` (or a ``LossScaleOptimizer`` around it) as its optimizer,
    or ``None``."""
    require(MODEL_BEING_LOADED, package)
    return model_up_the_stack(optimizer, package.Model)


class NewOptimizerHooks:
    """The wrapper's overrides of Keras 2 (new API) private hooks."""

    def _create_iteration_variable(self) -> None:
        # No counter of its own: the wrapper's `iterations` is the inner's.
        pass

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        # Keras 2's SavedModel loader revives every saved optimizer as a
        # `RestoredOptimizer`, whose `_iterations` variable must be bound to a
        # saved one, or `load_model` fails. So this node lists the inner
        # optimizer's `iterations` under `_iterations` too: one variable, one
        # saved value, reached by two names.
        require(tf_compat.TRACKABLE, tf)
        children = super()._trackable_children(save_type, **kwargs)
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or "_iterations" in children:
            return children
        return {**children, "_iterations": inner.iterations}

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        if name == "_iterations" and "inner_optimizer" in self.__dict__:
            return self.inner_optimizer.iterations
        return super()._lookup_dependency(name, cached_dependencies)


NADAM_U_PRODUCT = private(
    "<keras2>.optimizers.Nadam: _u_product_counter (a Python counter read in update_step)",
    "tf_keras",
    "Keras 2's Nadam advances _u_product in the first update_step it traces (a Python counter "
    "decides which): traced, if that first update_step is a variable gated off for the window, "
    "_u_product does not move and the other variables divide by 1 - _u_product = 0 at the first "
    "update; the wrapper hands Nadam the variables with a gradient first",
    CHECKED,
    lambda p: _reads_u_product_counter(p.optimizers.Nadam),
)


def _reads_u_product_counter(nadam: type) -> Any:
    import inspect

    if "_u_product_counter" not in inspect.getsource(nadam.update_step):
        raise AttributeError("Nadam.update_step no longer reads _u_product_counter")
    return nadam.update_step


def _traces_per_step_state_in_first_update(opt: Any, package: Any) -> bool:
    """Does ``opt`` (Keras 2 Nadam) advance a per-step state in whichever
    ``update_step`` it traces first?"""
    nadam = getattr(package.optimizers, "Nadam", None)
    if nadam is None or not isinstance(opt, nadam):
        return False
    require(NADAM_U_PRODUCT, package)
    return True


def install_new_api_gates(inner: Any, variables: Sequence[Any], gates: dict, package: Any) -> Callable[[], None]:
    """Gate the per-variable mutations of a Keras 2 new-API ``inner``
    optimizer for the variables in ``gates`` (index in ``variables`` ->
    boolean scalar): ``update_step`` and the EMA (in the cross-replica apply
    where Keras 2 runs them), weight decay (in a merge_call of its own, with
    Keras 2's per-variable formula inside ``distribution.extended.update``),
    the constraint. The inner optimizer's own XLA ``update_step``
    (``jit_compile``, GPU only) is off for such an update, since its compiled
    function cannot take the gate. Returns the function that undoes it."""
    plain_weight_decay = require(BASE_WEIGHT_DECAY, package)
    opt = inner
    keyed = {var_key(opt, variables[i]): g for i, g in gates.items()}

    def key(v: Any) -> Any:
        return var_key(opt, v)

    orig_update_step = opt.update_step
    orig_weight_decay = opt._apply_weight_decay
    orig_ema = opt._update_model_variables_moving_average
    orig_overwrite = opt._overwrite_model_variables_with_average_value

    def update_step(gradient: Any, variable: Any) -> Any:
        gate = keyed.get(key(variable))
        if gate is None:
            return orig_update_step(gradient, variable)
        return tf.cond(gate, lambda: _none(orig_update_step(gradient, variable)), _noop)

    def apply_weight_decay(var_list: Any) -> None:
        var_list = list(var_list)
        orig_weight_decay([v for v in var_list if key(v) not in keyed])
        gated = [v for v in var_list if key(v) in keyed]
        if not gated or opt.weight_decay is None:
            return

        def gated_decay(distribution: Any, gated: list) -> None:
            for v in gated:
                gate = keyed[key(v)]

                def decay(var: Any, gate: Any = gate) -> Any:
                    return tf.cond(gate, lambda: _none(plain_weight_decay(opt, [var])), _noop)

                distribution.extended.update(v, decay, group=False)

        tf_compat.maybe_merge_call(gated_decay, opt._distribution_strategy, gated)

    def per_variable(orig: Callable) -> Callable:
        def gated_fn(var_list: Any) -> None:
            var_list = list(var_list)
            orig([v for v in var_list if key(v) not in keyed])
            for v in var_list:
                gate = keyed.get(key(v))
                if gate is not None:
                    tf.cond(gate, lambda v=v: _none(orig([v])), _noop)

        return gated_fn

    patches = {
        "update_step": update_step,
        "_apply_weight_decay": apply_weight_decay,
        "_update_model_variables_moving_average": per_variable(orig_ema),
        "_overwrite_model_variables_with_average_value": per_variable(orig_overwrite),
    }
    if _traces_per_step_state_in_first_update(opt, package):
        orig_apply = opt.apply_gradients

        def apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            # The variables with a gradient on this micro-step first (one at
            # least, except in a flush), so that Nadam's first traced
            # update_step, which advances _u_product, is not a gated one.
            pairs = list(grads_and_vars)
            pairs = [p for p in pairs if key(p[1]) not in keyed] + [p for p in pairs if key(p[1]) in keyed]
            return orig_apply(pairs, *args, **kwargs)

        patches["apply_gradients"] = apply_gradients
    for attr, fn in patches.items():
        object.__setattr__(opt, attr, fn)
    jit_compile = opt.jit_compile
    opt.jit_compile = False
    undo = [lambda: [object.__delattr__(opt, a) for a in patches], lambda: setattr(opt, "jit_compile", jit_compile)]
    return tf_compat.gate_constraints(variables, gates, undo)


# ------------------------------------------------------------ losses
LOSS_HELPERS = private(
    "<keras2>.losses.LossFunctionWrapper, <keras2>.utils.losses_utils (get_mask, "
    "apply_valid_mask, squeeze_or_expand_dimensions)",
    "tf_keras",
    "CountedLoss turns a loss function into a Loss the way compile does (the class is not "
    "exported), and finds the shape Keras 2's Loss.__call__ divides by: the prediction's and the "
    "losses' masks (kept in a private tensor attribute, with no public reader), their merge into "
    "the sample weights and the weights' rank alignment",
    CHECKED,
    lambda p: (_module_of(p.losses.Loss).LossFunctionWrapper,) + attributes(
        _module_of(p.losses.Loss).losses_utils, "get_mask", "apply_valid_mask", "squeeze_or_expand_dimensions"),
)


def loss_function_wrapper(package: Any) -> type:
    """``package``'s ``LossFunctionWrapper`` (what ``compile`` wraps a loss function in)."""
    return require(LOSS_HELPERS, package)[0]


def losses_utils(package: Any) -> Any:
    """``package``'s ``losses_utils`` module: ``get_mask``, ``apply_valid_mask``,
    ``squeeze_or_expand_dimensions``."""
    require(LOSS_HELPERS, package)
    return _module_of(package.losses.Loss).losses_utils


# ------------------------------------------------------ legacy OptimizerV2
OPTIMIZER_V2 = private(
    "<keras2>.optimizers.legacy.Optimizer (optimizer_v2): _var_key (module function), "
    "_create_all_weights, _weights, _hypers_created, _track_trackable, "
    "_distribution_strategy_scope, _HAS_AGGREGATE_GRAD, _hyper, _get_hyper, _set_hyper, "
    "_compute_gradients",
    "tf_keras",
    "the key OptimizerV2 indexes slots by (the distributed container's for a replica's "
    "component); the hook that creates an optimizer's slots and hyperparameters (Keras 2 calls it "
    "to load .h5 optimizer weights, and the wrapper calls it on its inner optimizer at build); "
    "the list `weights` returns; the flag saying hyperparameters exist (the wrapper has none); "
    "tracking the inner optimizer as a checkpoint dependency; the strategy scope the optimizer "
    "was created in; whether apply_gradients aggregates (the wrapper passes the flag through); the "
    "hyperparameters and their reader and writer (read and assigned through the wrapper, as on "
    "the optimizer compiled with, they reach the inner optimizer's); the gradient computation of "
    "minimize (the wrapper's minimize takes decay_var_list and weight, which OptimizerV2's drops)",
    CHECKED,
    lambda p: (_module_of(p.optimizers.legacy.Optimizer)._var_key,) + attributes(
        p.optimizers.legacy.Optimizer, "_create_all_weights", "_distribution_strategy_scope", "_track_trackable",
        "_get_hyper", "_set_hyper", "_compute_gradients"),
)


def legacy_var_key(package: Any) -> Callable[[Any], Any]:
    """``optimizer_v2._var_key`` of ``package``."""
    require(OPTIMIZER_V2, package)
    return _module_of(package.optimizers.legacy.Optimizer)._var_key


def legacy_adopt(optimizer: Any, inner: Any) -> None:
    """Make the wrapper ``optimizer`` an ``OptimizerV2`` without
    hyperparameters of its own, whose checkpoint holds ``inner`` as
    ``inner_optimizer``."""
    optimizer._hypers_created = True
    optimizer._track_trackable(inner, "inner_optimizer")


def legacy_hyperparameter_names(optimizer: Any) -> Any:
    """The names of ``optimizer``'s hyperparameters (``_hyper``: ``beta_1``,
    ``learning_rate``, ``decay``, ...); empty for ``None``."""
    return getattr(optimizer, "_hyper", {}).keys() if optimizer is not None else ()


def legacy_create_all_weights(optimizer: Any, var_list: Sequence[Any]) -> None:
    optimizer._create_all_weights(list(var_list))


def legacy_compute_gradients(optimizer: Any, loss: Any, var_list: Any, grad_loss: Any, tape: Any) -> list:
    """``(gradient, variable)`` pairs of ``loss``, as ``OptimizerV2.minimize``
    computes them (``loss`` a callable, or a tensor with its ``tape``)."""
    return optimizer._compute_gradients(loss, var_list=var_list, grad_loss=grad_loss, tape=tape)


def legacy_own_weights(optimizer: Any) -> list:
    """The list ``OptimizerV2.weights`` returns (``_weights``), live."""
    return optimizer._weights


def legacy_strategy_scope(optimizer: Any) -> Any:
    return optimizer._distribution_strategy_scope()


class LegacyHooks:
    """The wrapper's overrides of ``OptimizerV2`` private hooks and flags.

    The per-variable hooks (``_create_slots``, ``_prepare``,
    ``_resource_apply_*``) refuse to run: only an optimizer wrapped *around*
    this one (tfa's ``Lookahead(AccumulatingOptimizer(...))``) calls them, and
    it would drive the update on every micro-step."""

    _HAS_AGGREGATE_GRAD = True
    _WRAP_OUTSIDE = (
        "AccumulatingOptimizer cannot be the inner optimizer of an optimizer "
        "wrapper that calls its per-variable update hooks ({hook}), such as "
        "tensorflow-addons' Lookahead, MovingAverage or SWA: that wrapper would "
        "drive the update on every micro-step and count micro-steps. Put the "
        "accumulation outside instead, where those wrappers see updates: "
        "AccumulatingOptimizer(tfa.optimizers.Lookahead(inner), "
        "gradient_accumulation_steps=N)."
    )

    def _create_all_weights(self, var_list: Sequence[Any]) -> None:
        self.build(var_list)

    # The wrapper has no hyperparameters of its own: `_get_hyper`/`_set_hyper`
    # (which user code and Keras 2's own tests call on the optimizer they
    # compiled with) reach the inner optimizer's.
    def _get_hyper(self, name: str, dtype: Any = None) -> Any:
        return self.inner_optimizer._get_hyper(name, dtype)

    def _set_hyper(self, name: str, value: Any) -> None:
        self.inner_optimizer._set_hyper(name, value)

    def _inner_hyperparameters(self) -> Any:
        return legacy_hyperparameter_names(self.__dict__.get("inner_optimizer"))

    def _create_slots(self, var_list: Any) -> None:
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_create_slots"))

    def _prepare(self, var_list: Any) -> Any:
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_prepare"))

    def _prepare_local(self, var_device: Any, var_dtype: Any, apply_state: Any) -> None:
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_prepare_local"))

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_resource_apply_dense"))

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_resource_apply_sparse"))

    def _resource_apply_sparse_duplicate_indices(self, grad, var, indices, apply_state=None):
        raise RuntimeError(self._WRAP_OUTSIDE.format(hook="_resource_apply_sparse_duplicate_indices"))


def legacy_optimizer_tree(optimizer: Any) -> list:
    """``optimizer`` and the optimizers whose ``apply_gradients`` it calls
    (tfa ``MultiOptimizer``'s ``optimizer_specs``)."""
    found = [optimizer]
    for spec in getattr(optimizer, "optimizer_specs", None) or []:
        found += legacy_optimizer_tree(spec["optimizer"])
    return found


LEGACY_APPLY = private(
    "<keras2>.optimizers.legacy.Optimizer._resource_apply_dense, "
    "_resource_apply_sparse_duplicate_indices, _dense_apply_args, _sparse_apply_args "
    "(replaced on the instance during one traced update)",
    "tf_keras",
    "the per-variable updates of OptimizerV2.apply_gradients (in tfa they include the decoupled "
    "weight decay, Lookahead's sync and MovingAverage's average): a variable without a gradient "
    "in the window must not be updated, which is known only when the step runs; Keras caches the "
    "hooks' argument lists per instance, filled from the real methods before shadowing them",
    CHECKED,
    lambda p: attributes(p.optimizers.legacy.Optimizer, "_resource_apply_dense",
                         "_resource_apply_sparse_duplicate_indices", "_dense_apply_args", "_sparse_apply_args"),
)


def install_legacy_gates(
    inner: Any, variables: Sequence[Any], gates: dict, package: Any
) -> Callable[[], None]:
    """Gate ``inner``'s (and its tfa ``MultiOptimizer`` children's)
    per-variable updates and the variables' constraints for the variables in
    ``gates`` (index in ``variables`` -> boolean scalar). Returns the undo."""
    require(LEGACY_APPLY, package)
    key = legacy_var_key(package)
    keyed = {key(variables[i]): g for i, g in gates.items()}
    optimizers = legacy_optimizer_tree(inner)
    for opt in optimizers:
        _ = opt._dense_apply_args, opt._sparse_apply_args
    methods = ("_resource_apply_dense", "_resource_apply_sparse_duplicate_indices")
    return tf_compat.gate_constraints(variables, gates, [tf_compat.patch_per_variable(optimizers, methods, keyed, key)])


def _none(_: Any) -> None:
    return None


def _noop() -> None:
    return None


# ------------------------------------------------------ tensorflow-addons
TFA_AVERAGE_CHECKPOINT = private(
    "tensorflow_addons.callbacks.AverageModelCheckpoint._get_optimizer",
    "tensorflow-addons",
    "the hook by which tfa's AverageModelCheckpoint finds the MovingAverage/SWA optimizer it "
    "saves the averages of (it unwraps a LossScaleOptimizer by its type name, nothing else, and "
    "refuses the model when the result is not an AveragedOptimizerWrapper); the subclass "
    "overrides it to unwrap AccumulatingOptimizer too. tfa has no public route (end of life at 0.23)",
    "tensorflow-addons 0.23.0 (TF 2.15.1, Keras 2.15)",
    lambda tfa: attributes(tfa.callbacks.AverageModelCheckpoint, "_get_optimizer", "set_model"),
)


@functools.lru_cache(maxsize=None)
def average_model_checkpoint_class(wrapper_types: Callable[[], tuple]) -> type:
    """tensorflow-addons' ``AverageModelCheckpoint``, subclassed to find the
    ``MovingAverage``/``SWA`` optimizer inside an ``AccumulatingOptimizer``
    (instances of ``wrapper_types()``).

    Raises:
        ImportError: tensorflow-addons is not installed.
    """
    try:
        import tensorflow_addons as tfa
    except ImportError:
        raise ImportError(
            "accum_optimizer.AverageModelCheckpoint is tensorflow-addons' AverageModelCheckpoint for "
            "an AccumulatingOptimizer around tfa's MovingAverage or SWA; it needs tensorflow-addons "
            "(pip install 'accum_optimizer[addons]')."
        ) from None
    require(TFA_AVERAGE_CHECKPOINT, tfa)
    averaged = tfa.optimizers.AveragedOptimizerWrapper

    class AverageModelCheckpoint(tfa.callbacks.AverageModelCheckpoint):
        """``tfa.callbacks.AverageModelCheckpoint`` for
        ``AccumulatingOptimizer(tfa.optimizers.MovingAverage(...), N)`` (or
        ``SWA``), with or without the ``LossScaleOptimizer`` that
        ``mixed_float16`` puts outside: the same arguments and behaviour
        (it saves, and with ``update_weights=True`` assigns, the averages the
        inner ``MovingAverage``/``SWA`` keeps, one average step per update).
        tfa's own callback refuses the model: it finds only a
        ``MovingAverage``/``SWA`` that is ``model.optimizer`` itself.

        Raises:
            TypeError: (at ``fit``) the model's optimizer holds no
                ``MovingAverage``/``SWA`` (tfa's message).
        """

        def _get_optimizer(self) -> Any:
            optimizer = super()._get_optimizer()
            while not isinstance(optimizer, averaged) and isinstance(optimizer, wrapper_types()):
                optimizer = optimizer.inner_optimizer
            return optimizer

    AverageModelCheckpoint.__module__ = "accum_optimizer"
    return AverageModelCheckpoint


# ----------------------------------------------------------- BatchNormalization
BESSEL_TEST_ONLY = private(
    "<keras2>.layers.BatchNormalization._bessels_correction_test_only",
    "tf_keras",
    "whether Keras 2's fused BatchNormalization updates the moving variance with the fused op's "
    "unbiased batch variance (True, the default: only legacy V1 tests set False): the pooled "
    "BatchNormalization applies the same correction to the window's pooled variance",
    CHECKED,
    lambda p: p.layers.BatchNormalization().__dict__["_bessels_correction_test_only"],
)


def fused_variance_is_unbiased(layer: Any, package: Any) -> bool:
    """Does ``layer`` (a built Keras 2 ``BatchNormalization``) move its
    moving variance with the unbiased batch variance (its fused path)?"""
    require(BESSEL_TEST_ONLY, package)
    return bool(layer.fused) and bool(layer._bessels_correction_test_only)
