"""The TensorFlow route of the wrappers of the three ``tf.function``
families: Keras 3 on TensorFlow, the Keras 2 new optimizer API, and legacy
``OptimizerV2``/tensorflow-addons.

:class:`TFRoute` extends the framework-neutral
:class:`accum_optimizer.families._accumulating.AccumulatingBase` with, once for
the three:

* the micro-step's route under ``tf.distribute``: one ``merge_call`` per
  micro-step, the window's ``cond`` in cross-replica context, each replica
  adding into its own (``ON_READ``) accumulators, and on updates handing its
  local window gradient to the inner optimizer, whose all-reduce is the one
  cross-replica reduction of the window (:meth:`TFRoute._enter_window`);
* the op a micro-step returns in a ``tf.compat.v1`` graph or a
  ``tf.function``, and :meth:`TFRoute.flush` (a ``tf.function``, or the
  op in a v1 graph);
* the TensorFlow checks of gradients and weights.

The algorithm is :mod:`accum_optimizer.core`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer import _args, core
from accum_optimizer._compat import tf as tf_compat
from accum_optimizer.families import _accumulating
from accum_optimizer.families._accumulating import variable_name
from accum_optimizer.families._tf_backend import (
    TF2Backend,
    TF2GraphBackend,
    as_gradients,
    check_gradient_shapes,
    check_strategy,
    check_weight,
    control_inputs,
    shape_checked,
    tf_variable,
)


def unconverted(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` kept out of AutoGraph (``tf.autograph.experimental.do_not_convert``),
    and with it everything it calls: the adapters and the core branch with
    explicit ``tf.cond`` s only, and TensorFlow, Keras and tf_keras keep their
    own code out of AutoGraph the same way (``DoNotConvert`` in AutoGraph's
    config). Converted, the wrapper's code cost more to trace than all the
    rest of a train step: on ``transformer_wide`` 8,750 conversions, 15.7 s
    of the 41.5 s first trace (Keras' built-in: 2 conversions, 0.1 s),
    measured by cProfile around the trace (``docs/performance.md``; the trace
    times are ``python -m benchmarks.step_profile``'s)."""
    return tf.autograph.experimental.do_not_convert(method)


def replicas_of(distribution: Any) -> core.Replicas:
    """:class:`~accum_optimizer.core.Replicas` of a strategy, reached from
    cross-replica context (inside ``merge_call``)."""

    def each(fn: Callable[..., Any], *args: Any) -> Any:
        return distribution.extended.call_for_each_replica(fn, args=args)

    def all_replicas(flag: Any) -> Any:
        # The skipping policies' one scalar all-reduce per micro-step.
        bad = distribution.reduce(tf.distribute.ReduceOp.SUM, each(_nonfinite_count, flag), axis=None)
        return tf.equal(bad, 0.0)

    return core.Replicas(distribution.num_replicas_in_sync, each, all_replicas)


def _nonfinite_count(flag: Any) -> Any:
    return tf.cast(tf.logical_not(flag), tf.float32)


def check_replica_context() -> None:
    """Raise ValueError in cross-replica context (a micro-step is a replica's)."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "AccumulatingOptimizer.apply() / apply_gradients() must be called "
            "in a replica context (e.g. inside strategy.run), not cross-replica context."
        )


def replicas_in_sync() -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync


def in_v1_graph() -> bool:
    """Building a ``tf.compat.v1`` graph (not eagerly, not inside a
    ``tf.function``): nothing runs that is not fetched or ordered."""
    return not tf.executing_eagerly() and not tf.inside_function()


def step_op(parts: Any, name: str | None = None) -> Any:
    """The op of one micro-step or flush, made of ``parts`` (the ops and
    outputs it made): ``None`` eagerly; inside a ``tf.function`` an op (the
    writes are ordered by automatic control dependencies), so that a caller
    that returns an op from a ``cond`` branch (Keras 2's
    ``LossScaleOptimizer``) gets one."""
    if tf.executing_eagerly():
        return None
    return tf.group(*control_inputs(parts), name=name)


class TFRoute(_accumulating.AccumulatingBase):
    """The TensorFlow route of the Keras 3 (TF), Keras 2 and legacy wrappers
    (:class:`accum_optimizer.families._accumulating.AccumulatingBase` holds what
    does not depend on TensorFlow)."""

    def _before_base(self, args: _args.Arguments) -> None:
        if _args.accumulates(args.steps, args.nonfinite):  # (the pass-through goes wherever its inner goes)
            check_strategy()

    def _check_strategy_at_build(self) -> None:
        """At build, under the strategy the variables live in (an optimizer
        created outside a strategy's scope and built inside it): refuse the
        strategies that cannot accumulate (:func:`check_strategy`)."""
        if self._accumulates:
            check_strategy()

    def _check_weight(self, weight: Any) -> Any:
        return check_weight(weight)

    def _backend(self) -> TF2Backend:
        if in_v1_graph():
            return TF2GraphBackend(self._apply_inner)
        return TF2Backend(self._apply_inner, self._writer(), self._fence_variables())

    def _fence_variables(self) -> Any:
        """``fence_variables`` of :class:`TF2Backend` (every variable the
        inner update may write), or ``None``: the whole inner update then
        waits for the micro-step's guard (``core.apply_window``)."""
        return None

    def _checked_gradients(self, grads: Sequence[Any], variables: list) -> list:
        grads = as_gradients(grads, variables)
        check_gradient_shapes(grads, variables, variable_name)
        check_replica_context()
        return grads

    def _step_result(self, parts: Any, name: str | None) -> Any:
        return step_op(parts, name)

    def _executing_eagerly(self) -> bool:
        return tf.executing_eagerly()

    def _build_on_first_use(self, variables: list) -> None:
        # Eagerly, even while a `tf.function` is traced: a variable created
        # in the trace is initialised by a `tf.cond` of its own, lifted out
        # of the graph (41 ms per variable, 17 s of the first trace of
        # `transformer_wide`, whose accumulating optimizer has 413).
        # Except for a model built in this very trace (its first call, in
        # `fit` without a strategy): its variables get their values only
        # when the step runs, and an inner optimizer whose build reads them
        # (ScheduleFreeAdamW copies them into its momentum) builds in the
        # trace, as the plain optimizer does.
        if tf.inside_function() and not initialized_now(variables):
            self.build(variables)
            return
        with tf.init_scope():
            self.build(variables)

    def _enter_window(self, grads: list, weight: Any = None) -> Any:
        """Take one micro-step with ``grads`` (build order), in replica context.

        Under any strategy the ``cond`` that picks update steps runs in
        cross-replica context, inside one ``merge_call`` (as Keras'
        ``LossScaleOptimizer`` does): a replica-context ``cond`` cannot hold
        the update, because the inner optimizer's ``iterations`` (and
        ``grad_received``) are ``ONLY_FIRST_REPLICA`` variables, every update
        of which in replica context is a ``merge_call``, which fails inside a
        ``cond`` (the crash of Keras' built-in accumulation). That holds for
        strategies that otherwise need no ``merge_call`` (MirroredStrategy
        under XLA on GPUs) too, so they take the same path.

        Raises:
            ValueError: called in cross-replica context.
        """
        checked = shape_checked(grads, self._build_order, variable_name)
        if not tf.distribute.has_strategy():
            return self._micro_step(checked, core.ONE_REPLICA, weight)
        return tf.distribute.get_replica_context().merge_call(
            self._cross_replica_step, args=(checked,), kwargs={"weight": weight}
        )

    def _cross_replica_step(self, distribution: Any, grads: list, finite: Any = None, weight: Any = None) -> Any:
        # Once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        return self._micro_step(grads, replicas_of(distribution), weight, finite)

    def _after_inner_update(self, window_grads: list) -> None:
        # The inner optimizer scatter-updated the variables of sparse
        # windows: keep their next reads (the forward passes) from copying.
        for g, v in zip(window_grads, self._build_order):
            if isinstance(g, tf.IndexedSlices):
                tf_compat.disable_copy_on_read(v)

    def _record_skipped_micro_step(self) -> None:
        """A micro-step that a ``LossScaleOptimizer`` outside skipped."""
        grads = [None] * len(self._build_order)
        if tf.distribute.in_cross_replica_context():
            self._cross_replica_step(tf.distribute.get_strategy(), grads, finite=False)
        else:
            self._micro_step(grads, core.ONE_REPLICA, finite=False)

    def _outside_functions(self) -> Any:
        return outside_functions()

    def _colocated_with(self, reference: Any) -> Any:
        return colocated_with(self, reference)

    def _build_for_loading(self, model: Any) -> None:
        build_for_loading(model)

    @unconverted
    def flush(self) -> Any:
        """Apply the current, partial window now as one update, if it holds
        at least one micro-step; a no-op on an empty window.

        The update is normalised by what the window holds (``"mean"``: its
        micro-steps, or the sum of their counts when weighted; never by N),
        exactly what a large batch of the window's samples would apply; then
        a new window starts. ``iterations`` moves by one, ``micro_steps``
        does not, and ``mini_step`` (the window's position) restarts at 0.
        Works eagerly and inside ``tf.function``, with or without a
        ``tf.distribute`` strategy (call it where you would call ``fit``, in
        cross-replica context); runs in the strategy the optimizer was
        created under. Lightning's forced step at epoch end divides by N
        instead (Lightning#19987); this one does not.
        ``accum_optimizer.FlushPartialWindow`` calls it at every epoch end.

        A window that a skipping policy marked non-finite is discarded, as
        its closing micro-step would; a window whose counts sum to 0 applies
        nothing.

        Returns:
            In a ``tf.compat.v1`` graph (TF1-style code, where nothing runs
            unless fetched): the op that flushes, to ``sess.run`` at the end
            of an epoch (as the TF1 family's ``flush``). Otherwise ``None``:
            the flush has run.

        Raises:
            ValueError: called inside ``strategy.run`` (replica context), or
                before the optimizer is built.
        """
        if not self._accumulates:
            return tf.no_op() if in_v1_graph() else None
        self._check_flushable()
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.flush() must be called in cross-replica "
                "context (outside strategy.run), like model.fit."
            )
        if in_v1_graph():
            with strategy_scope(self):
                return step_op(self._flush_step())
        function = self._window.context.get("flush_function")
        if function is None:
            # (One function per optimizer: tf.function's retracing warning
            # would count one shared bound method across instances.)
            function = tf.function(lambda: self._flush_step(), autograph=False)
            self._window.context["flush_function"] = function
        with strategy_scope(self):
            function()

    def _flush_step(self) -> Any:
        if not tf.distribute.has_strategy():
            return self._flush_window(core.ONE_REPLICA)
        return tf.distribute.get_strategy().run(
            lambda: tf.distribute.get_replica_context().merge_call(
                lambda d: self._flush_window(replicas_of(d))
            )
        )

    def _remember_strategy(self) -> None:
        """The strategy in scope at construction (the default strategy if
        none): ``flush`` runs in it (callbacks run outside its scope), and
        the accumulators are placed beside their variables by it."""
        self._window.context["strategy"] = tf.distribute.get_strategy()



def initialized_now(variables: Sequence[Any]) -> bool:
    """Do all ``variables`` hold their values outside the function being
    traced (not created in it, whose run initialises them)?"""
    with tf.init_scope():
        return all(bool(tf_variable(v).is_initialized()) for v in variables)


def strategy_scope(owner: Any) -> Any:
    """The scope of the strategy ``owner`` was created under, unless a
    strategy is in scope already."""
    strategy = owner._window.context.get("strategy")
    if strategy is None or tf.distribute.has_strategy():
        return contextlib.nullcontext()
    return strategy.scope()


def colocated_with(owner: Any, reference: Any) -> Any:
    """Place variables created in this context beside ``reference`` (by the
    strategy ``owner`` was created under)."""
    strategy = owner._window.context.get("strategy") or tf.distribute.get_strategy()
    return strategy.extended.colocate_vars_with(tf_variable(reference))


def outside_functions() -> Any:
    """Eager context even while a ``tf.function`` is being traced."""
    return tf.init_scope()


# ---------------------------------------------------------------- saving
def build_for_loading(model: Any) -> None:
    """Build ``model``'s optimizer for ``model.load_weights`` as its first
    train step would: the state loaded is then restored at once."""
    with model.distribute_strategy.scope(), outside_functions():
        model.optimizer.build(model.trainable_variables)
