"""`AccumulatingOptimizer` for TF1 graph code (``tf.compat.v1.train.Optimizer``).

A ``tf.compat.v1.train.Optimizer`` that wraps another one, for code built on
``tf.compat.v1``: placeholders, ``Session``, ``global_step``, ``Saver``,
``MonitoredTrainingSession``. ``minimize``/``apply_gradients`` return one
``train_op``; each run of it is one *micro-step*, and every
``gradient_accumulation_steps``-th run is an *update* that calls the inner
optimizer's ``apply_gradients`` once with the window's gradient (and the
``global_step``, which so counts updates). The algorithm is
:func:`accum_optimizer.core.micro_step`; this module supplies the TF1
:class:`_TF1Backend` (assignments that return ops, ``tf.cond`` whose
branches return grouped ops) and creates the state at graph construction.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import tensorflow as tf

from accum_optimizer import _args, core
from accum_optimizer._compat import tf as compat
from accum_optimizer.families import _tf1_graph as graph
from accum_optimizer.families._accumulating import no_gradients, variable_name

from accum_optimizer.families._tf_backend import check_weight, validate_accumulator_dtype

tf1 = tf.compat.v1


class AccumulatingOptimizer(compat.InnerSlots, compat.TF1Trackable, _args.Constructor, tf1.train.Optimizer):
    """Accumulate gradients over micro-batches, update once per window (TF1).

    ``opt.minimize(loss, global_step=global_step, var_list=...)`` (or
    ``compute_gradients`` + ``apply_gradients``) returns one op; each
    ``sess.run`` of it is one *micro-step*: the gradients are added into
    accumulators (one non-trainable variable per trained variable, its shape
    and dtype). On every ``gradient_accumulation_steps``-th run the inner
    optimizer's ``apply_gradients`` is called once with the window's gradient
    (the mean, or the sum, of the micro-batch gradients) and the
    ``global_step`` (incremented once, so it counts *updates*), then the
    accumulators are zeroed. On the other runs the variables, every variable of
    the inner optimizer (slots, Adam's beta powers) and ``global_step`` stay
    bitwise unchanged. ``N`` micro-batches of ``B`` samples so train like one
    batch of ``N * B`` when the loss is a mean over its batch.

    Args:
        inner_optimizer: a ``tf.compat.v1.train.Optimizer`` instance (Adam,
            Momentum, Ftrl, ...). Learning-rate schedules built on
            ``global_step`` see update counts.
        gradient_accumulation_steps: ``int >= 1``, the number ``N`` of
            micro-steps per update. ``1`` is a pass-through to the inner
            optimizer (no accumulators). Or a schedule, as in Keras 3: a dict
            ``{first_update: N}`` or a callable ``update_index -> N`` (of an
            int64 tensor, N computed in the graph), the updates counted in
            :attr:`updates` (TF1 optimizers count none of their own).
        reduction: ``"mean"`` (default) applies ``sum / N``; ``"sum"`` applies
            the sum of the ``N`` micro-batch gradients.
        name: name of the wrapper's variables and ops (default
            ``"AccumulatingOptimizer"``).
        nonfinite: ``"propagate"`` (default), ``"skip_micro_step"``,
            ``"skip_window"``: the Keras 3 family's policies (counted in
            :attr:`skipped_micro_steps`, :attr:`skipped_windows`).
        accumulator_dtype: ``None`` (each variable's dtype, as the
            accumulators of earlier versions, so that their checkpoints
            restore) or a float dtype (``"float32"`` for 16-bit variables).

    State (created at graph construction, by the first
    ``apply_gradients``/``minimize`` or by :meth:`build`; non-trainable
    global variables, so a default ``Saver`` keeps them, never in
    ``TRAINABLE_VARIABLES``; always resource variables):
        ``micro_steps``: int64 scalar, micro-steps taken (units: micro-steps).
        ``grad_received``: int64 ``(num_variables,)``, 1 where a variable has
            had a gradient in the current window.
        accumulators (``get_slot(var, "acc_grad")``): one per variable, its
            shape and dtype, named ``<var>/<name>/acc_grad``.
        row trackers (``get_slot(var, "touched_rows")``): int8
            ``(var.shape[0],)``, for variables whose gradient is a
            ``tf.IndexedSlices`` (embedding lookups, ``tf.gather``): the update
            hands the inner optimizer the window's touched rows as
            ``tf.IndexedSlices``, as the large batch would, so lazy sparse
            updates (``MomentumOptimizer``'s) match it.
        ``mini_step`` (int64 scalar, the window's position, 0 in a fresh
            state; a checkpoint saved without it, restored mid-window with
            a ``Saver`` over the other variables, resumes at
            ``micro_steps % N``, its position then) and ``window_weight``
            (float32 scalar, the window's ``Σ cᵢ``), after the accumulators
            in :meth:`accumulation_variables`.

    Weighted micro-batches (``minimize``/``apply_gradients(..., weight=c)``,
    ``c`` a number or a tensor such as a placeholder) and the partial window
    (:meth:`flush`, an op to run at the end of an epoch) follow the Keras 3
    family; the window's gradient is ``Σ cᵢ·gᵢ / Σ cᵢ`` under ``"mean"``.
    The skip counters (skipping policies) and :attr:`updates` (schedules)
    are global variables after ``window_weight`` in
    :meth:`accumulation_variables`.

    One wrapper is one window: every run of any op it returned is a micro-step
    of the same window, and the update applies every variable that had a
    gradient in the window (a variable with none is not updated at all). The
    variables are fixed when the wrapper is built (in each graph). To share one
    wrapper between train ops whose variables differ, call
    ``build(union_of_var_lists)`` first; for separate windows (a GAN's two
    networks, say), use one wrapper per train op.

    ``tf.distribute`` strategies (``MirroredStrategy`` in TF1 graph mode, say)
    are out of scope: ``apply_gradients`` under one raises
    ``NotImplementedError``.

    Raises:
        TypeError: ``inner_optimizer`` is not a ``tf.compat.v1.train.Optimizer``,
            ``gradient_accumulation_steps`` is not an int, dict or callable, a required argument
            is missing, or an unexpected keyword argument is given (the
            message names the close match).
        ValueError: ``gradient_accumulation_steps < 1`` (or a bad schedule);
            ``nonfinite`` or ``accumulator_dtype`` not accepted; ``reduction`` not in
            ``("mean", "sum")``; the inner optimizer is an
            ``AccumulatingOptimizer``; ``use_locking`` is passed (it belongs on
            the inner optimizer).
    """

    _INNER_ONLY = {"use_locking": False}
    _NONFINITE = core.NONFINITE_POLICIES

    def _check_accumulator_dtype(self, value: Any) -> str | None:
        return validate_accumulator_dtype(value)

    def _family_models(self) -> str:
        return "TF1 family (tf.compat.v1 graph code)"

    def _inner_example(self) -> str:
        return "tf.compat.v1.train.AdamOptimizer"

    def _inner_spec(self) -> _args.InnerSpec:
        return _args.InnerSpec(
            "a TF1 optimizer instance (`tf.compat.v1.train.Optimizer`, e.g. "
            "tf.compat.v1.train.AdamOptimizer(1e-3))",
            tf1.train.Optimizer,
        )

    def _base_arguments(self, args: _args.Arguments) -> dict:
        return {"use_locking": False, "name": args.name or "AccumulatingOptimizer"}

    def _init_state(self, args: _args.Arguments) -> None:
        self._inner = args.inner
        self.reduction = args.reduction
        self.nonfinite = args.nonfinite
        self.accumulator_dtype = args.accumulator_dtype
        self._windows: dict[Any, graph.GraphWindow] = {}

    def _graph_window(self) -> graph.GraphWindow | None:
        """This wrapper's window in the current graph (``None`` before it is built there)."""
        return self._windows.get(graph.graph_key())

    @property
    def inner_optimizer(self) -> tf1.train.Optimizer:
        """The wrapped optimizer, which makes every update."""
        return self._inner

    @property
    def micro_steps(self) -> Any:
        """int64 scalar variable: micro-steps taken in the current graph (or
        eagerly), i.e. runs of this optimizer's ops. ``None`` before the
        optimizer is built there."""
        window = self._graph_window()
        return None if window is None else window.micro_steps

    # ------------------------------------------------------------------ state
    def build(self, var_list: Sequence[Any], sparse_var_list: Sequence[Any] = ()) -> None:
        """Create the accumulation state for ``var_list`` in the current graph.

        ``apply_gradients``/``minimize`` build the optimizer by themselves,
        for the variables that have a gradient in that first call. Call
        ``build`` first when several train ops share this optimizer and their
        variables differ: the update, whichever op runs it, must know every
        variable. Creates (under ``tf.init_scope``, outside any ``cond``) the
        accumulators, counters and the inner optimizer's slots (its
        ``_create_slots``, which its ``apply_gradients`` would call).

        Args:
            var_list: the variables the train ops will update.
            sparse_var_list: those among them whose gradients are
                ``tf.IndexedSlices`` (embedding tables): they get a row
                tracker, so the update hands the inner optimizer the touched
                rows only. ``apply_gradients`` finds them by itself.

        Raises:
            TypeError: an element is not a ``tf.Variable``.
            ValueError: ``var_list`` is empty or has a variable twice,
                ``sparse_var_list`` is not a subset of it, or the optimizer
                is already built in this graph for other variables.
        """
        var_list, sparse = graph.check_build_arguments(var_list, sparse_var_list)
        window = self._graph_window()
        if window is not None:
            unknown = [v.name for v in window.unknown(var_list)]
            if unknown:
                raise ValueError(graph.unknown_message(self.get_name(), unknown, window))
            return
        self._build(var_list, {v.ref() for v in sparse})

    def _build(self, var_list: list, sparse_refs: set) -> graph.GraphWindow:
        accumulates = _args.accumulates(self.gradient_accumulation_steps, self.nonfinite)
        # The skip counters (a skipping policy) and, for a schedule, the
        # updates taken (what picks the window's N: TF1 optimizers count no
        # updates of their own).
        counters = list(dict.fromkeys(core.skip_counters(self.nonfinite) + self._rules().needs()))
        with tf.init_scope():
            key = graph.graph_key()
            micro_steps, state = graph.make_state(
                self._own_variable, self.get_name(), var_list, sparse_refs, counters if accumulates else None,
                lambda v: _args.accumulator_dtype_for(v.dtype.base_dtype.name, self.accumulator_dtype, widen=False),
            )
            if accumulates:
                # The slots the inner optimizer's `apply_gradients` would
                # create (it does so under `init_scope` too), made now: in
                # eager mode the update's `tf.cond` runs only on updates, and
                # slot names must not depend on where they are first made.
                compat.tf1_create_slots(self._inner, var_list)
        window = graph.GraphWindow(self._inner, list(var_list), state, micro_steps)
        self._windows[key] = window
        return window

    def _own_variable(self, name: str, initial_value: Any, colocate_with: Any, slot: tuple | None = None) -> Any:
        """A non-trainable resource variable in ``GLOBAL_VARIABLES``.

        Resource variables even when the model's are ``RefVariable``s: the
        shared algorithm reads them after writing them in the same run, and
        only a resource variable's read is ordered by control dependencies
        (a ``RefVariable`` converts to the snapshot taken at its creation)."""
        with tf.distribute.get_strategy().extended.colocate_vars_with(colocate_with):
            variable = tf1.Variable(
                initial_value, trainable=False, name=name, use_resource=True,
                collections=[tf1.GraphKeys.GLOBAL_VARIABLES],
            )
        child = name if slot is None else f"{slot[0]}_{slot[1]}"
        compat.restore_deferred(self, child, variable)
        return variable

    @property
    def mini_step(self) -> Any:
        """int64 scalar variable: micro-steps in the current window (its
        position) in the current graph, 0 in a fresh state. ``None`` before
        the optimizer is built there, or for
        ``gradient_accumulation_steps == 1``."""
        window = self._graph_window()
        return None if window is None or window.state is None else window.state.mini_step

    skipped_micro_steps = graph.state_property("skipped_micro_steps", "non-finite micro-steps dropped")
    skipped_windows = graph.state_property("skipped_windows", 'windows discarded by ``"skip_window"``')
    updates = graph.state_property("updates", "updates taken (flushes included), what picks a schedule's N")

    @property
    def window_weight(self) -> Any:
        """float32 scalar variable: the current window's count ``Σ cᵢ`` (the
        ``weight`` of each micro-step, 1 without one). ``None`` as for
        :attr:`mini_step`."""
        window = self._graph_window()
        return None if window is None or window.state is None else window.state.window_weight

    def variables(self) -> list:
        """Every variable of the optimizer in the current graph: the wrapper's
        (:meth:`accumulation_variables`) followed by the inner optimizer's
        (its slots and non-slot variables such as Adam's beta powers)."""
        return self.accumulation_variables() + list(self._inner.variables())

    def accumulation_variables(self) -> list:
        """The wrapper's own variables in the current graph: ``micro_steps``,
        ``grad_received``, the accumulators and row trackers, ``mini_step``
        and ``window_weight``. A checkpoint
        written without accumulation lacks exactly these (see
        :meth:`non_accumulation_variables`)."""
        window = self._graph_window()
        return [] if window is None else window.own_variables()

    def non_optimizer_variables(self) -> list:
        """Global variables of the current graph that are not optimizer state:
        the model's variables and ``global_step``, without accumulators,
        counters or the inner optimizer's slots (graph mode: eagerly there
        are no collections). For an inference checkpoint::

            tf.compat.v1.train.Saver(var_list=opt.non_optimizer_variables())
        """
        return graph.global_variables_except(self.variables())

    def non_accumulation_variables(self) -> list:
        """Global variables of the current graph except this wrapper's own
        (:meth:`accumulation_variables`): what a checkpoint written by the
        same graph trained *without* accumulation holds (model, inner
        optimizer's slots, ``global_step``). To resume from such a checkpoint
        with the accumulators at zero::

            sess.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver(opt.non_accumulation_variables()).restore(sess, path)
        """
        return graph.global_variables_except(self.accumulation_variables())

    def get_slot(self, var: Any, name: str) -> Any:
        """``"acc_grad"`` / ``"touched_rows"``: the wrapper's accumulator / row
        tracker of ``var`` (``None`` if it has none); any other name: the
        inner optimizer's slot (``"m"``, ``"momentum"``, ...), as
        :meth:`get_slot_names` lists them (the inner optimizer's names).

        (A ``tf.train.Checkpoint`` saves this wrapper's state as its own
        dependencies and the inner optimizer's slots once, by the inner
        optimizer.)"""
        if name in ("acc_grad", "touched_rows"):
            window = self._graph_window()
            if window is None or window.state is None or window.unknown([var]):
                return None
            i = window.index_of(var)
            return window.state.acc_grads[i] if name == "acc_grad" else window.state.rows_tracker(i)
        return super().get_slot(var, name)

    def _checkpoint_children(self, children: dict) -> dict:
        """What ``tf.train.Checkpoint`` (eager) saves of this optimizer: the
        inner optimizer and this graph's state, by position in build order."""
        window = self._graph_window()
        return {**children, "inner_optimizer": self._inner, **(window.children() if window is not None else {})}

    # ------------------------------------------------------------ micro-step
    def compute_gradients(self, loss: Any, var_list: Any = None, **kwargs: Any) -> list:
        """The inner optimizer's ``compute_gradients`` (so that one that
        changes how gradients are computed, such as a loss-scaling one, still
        does)."""
        return self._inner.compute_gradients(loss, var_list=var_list, **kwargs)

    def minimize(self, loss: Any, global_step: Any = None, var_list: Any = None,
                 gate_gradients: int = tf1.train.Optimizer.GATE_OP, aggregation_method: Any = None,
                 colocate_gradients_with_ops: bool = False, name: str | None = None, grad_loss: Any = None,
                 weight: Any = None) -> Any:
        """``tf.compat.v1.train.Optimizer.minimize``, with the micro-step's
        ``weight`` (see :meth:`apply_gradients`): :meth:`compute_gradients`,
        then :meth:`apply_gradients`."""
        if weight is None:
            return super().minimize(
                loss, global_step=global_step, var_list=var_list, gate_gradients=gate_gradients,
                aggregation_method=aggregation_method, colocate_gradients_with_ops=colocate_gradients_with_ops,
                name=name, grad_loss=grad_loss,
            )
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss,
        )
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name, weight=weight)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], global_step: Any = None,
                        name: str | None = None, weight: Any = None) -> Any:
        """Return the op of one micro-step with ``grads_and_vars``.

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs, as from
                :meth:`compute_gradients`. A gradient is a dense tensor of its
                variable's shape, a ``tf.IndexedSlices`` or ``None`` (no
                contribution on this micro-step).
            global_step: optional int variable, incremented by one on each
                update (every ``gradient_accumulation_steps``-th run), never on
                the other micro-steps.
            name: name of the returned op (default: the optimizer's name).
            weight: the micro-batch's count ``c``, what its mean loss was
                taken over (samples, sum of sample weights, unmasked
                tokens): a Python number or a scalar tensor (a placeholder
                too) >= 0, finite; it may differ per run. The window applies
                ``Σ cᵢ·gᵢ / Σ cᵢ`` (``"mean"``) or ``Σ cᵢ·gᵢ`` (``"sum"``);
                a window whose counts sum to 0 applies nothing (the inner
                optimizer is not called, ``global_step`` does not move).
                ``None`` (default): 1, the unweighted window. The Keras 3
                family's semantics.

        Returns:
            In graph mode the op to run once per micro-batch (also added to
            ``GraphKeys.TRAIN_OP``); eagerly, ``None`` after the micro-step ran.

        Raises:
            TypeError: a pair is malformed, a variable is not a ``tf.Variable``,
                or a gradient is not convertible to a tensor.
            ValueError: ``grads_and_vars`` is empty, lists a variable twice,
                has no gradient at all, a gradient's shape differs from its
                variable's, or a variable with a gradient is not one the
                optimizer was built for; ``weight`` is not a scalar, is
                negative or not finite (a tensor: ``InvalidArgumentError``
                when the op runs, before any state changes).
            NotImplementedError: called under a ``tf.distribute`` strategy
                (out of scope for TF1 graph code).
        """
        if tf.distribute.has_strategy():
            raise NotImplementedError(
                "The TF1 AccumulatingOptimizer does not support tf.distribute "
                f"strategies (called under {type(tf.distribute.get_strategy()).__name__}); "
                "MirroredStrategy and the others are out of scope for TF1 graph "
                "code. Call it outside strategy.scope(), or use a Keras optimizer "
                "with the Keras wrapper under a strategy."
            )
        weight = check_weight(weight)
        pairs = graph.check_grads_and_vars(grads_and_vars)
        no_gradients([g for g, _ in pairs], [v for _, v in pairs], variable_name)
        with_grad = [(g, v) for g, v in pairs if g is not None]
        if not _args.accumulates(self.gradient_accumulation_steps, self.nonfinite):
            return self._pass_through(pairs, global_step, name, weight)

        window = self._graph_window()
        if window is None:
            window = self._build(
                [v for _, v in with_grad],
                {v.ref() for g, v in with_grad if isinstance(g, tf.IndexedSlices)},
            )
        unknown = [v.name for v in window.unknown([v for _, v in with_grad])]
        if unknown:
            raise ValueError(graph.unknown_message(self.get_name(), unknown, window))
        if window.global_step is None:
            window.global_step = global_step
        # Build order; variables without a gradient here get None.
        grads = window.in_build_order(*zip(*with_grad))
        with graph.train_op(name, self.get_name(), self._inner_update(window, global_step)) as step:
            step.parts = window.micro_step(step.backend, window.state, self._rules(), grads, weight=weight)
        return step.op

    def _rules(self) -> core.Rules:
        return core.Rules(self.gradient_accumulation_steps, self.reduction, self.nonfinite)

    def _inner_update(self, window: graph.GraphWindow, global_step: Any) -> Any:
        def apply_inner(window_grads: list, gates: dict) -> Any:
            with window.gated(gates):
                applied = self._inner.apply_gradients(
                    list(zip(window_grads, window.variables)), global_step=global_step
                )
            updates = window.state.updates
            if updates is None:
                return applied
            # The schedule's update count moves with the inner update.
            with tf.control_dependencies([] if applied is None else [applied]):
                return updates.assign_add(tf.constant(1, tf.int64), read_value=False)

        return apply_inner

    # --------------------------------------------------------- partial window
    def flush(self, global_step: Any = None, name: str | None = None) -> Any:
        """The op that applies the current, partial window as one update, if
        it holds at least one micro-step (a no-op on an empty window);
        ``sess.run`` it at the end of an epoch. Eagerly: runs it, returns
        ``None``.

        The update is normalised by what the window holds (``"mean"``: its
        micro-steps, or the sum of their counts when weighted; never by N),
        what a large batch of the window's samples would apply; then a new
        window starts (``mini_step = 0``). ``global_step`` moves by one,
        ``micro_steps`` does not. Every variable that had a gradient in the
        window is updated (the others are not); variables with row trackers
        get the sparse window over their touched rows. A window whose counts
        sum to 0 applies nothing. :func:`accum_optimizer.core.flush`,
        as the other families' ``flush``.

        Args:
            global_step: incremented by the update; default: the
                ``global_step`` of the first ``apply_gradients``/``minimize``
                in this graph.
            name: name of the returned op.

        Raises:
            ValueError: the optimizer is not built in this graph (no train op
                yet), or ``gradient_accumulation_steps == 1`` (no windows).
        """
        window = self._graph_window()
        if window is None or window.state is None:
            raise ValueError(
                "flush() needs an AccumulatingOptimizer built in this graph with "
                "gradient_accumulation_steps > 1 (create the train op with "
                "minimize/apply_gradients, or call build(var_list), first); "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}."
            )
        if global_step is None:
            global_step = window.global_step
        # (Not a train op: registered nowhere.)
        apply_inner = self._inner_update(window, global_step)
        with graph.train_op(name, f"{self.get_name()}_flush", apply_inner, register=False) as step:
            step.parts = window.flush(step.backend, window.state, self._rules())
        return step.op

    def _pass_through(self, pairs: list, global_step: Any, name: str | None, weight: Any = None) -> Any:
        """``gradient_accumulation_steps == 1``: the inner optimizer's update
        and ``micro_steps += 1`` (:func:`accum_optimizer.core.pass_through`)."""
        window = self._graph_window()
        if window is None:
            window = self._build([v for g, v in pairs if g is not None], set())
        variables = [v for _, v in pairs]
        if weight is not None:
            with tf.init_scope():
                # (Slots made outside the cond, as `_build` does.)
                compat.tf1_create_slots(self._inner, [v for g, v in pairs if g is not None])

        def update(grads: list) -> Any:
            return self._inner.apply_gradients(list(zip(grads, variables)), global_step=global_step, name=name)

        with graph.train_op(name, self.get_name()) as step:
            step.parts = core.pass_through(
                step.backend, window.micro_steps, [g for g, _ in pairs], update, self.reduction, weight
            )
        return step.op if step.op is not None else step.parts[0]
