"""What the Keras families' drivers share (:class:`KerasDriver`): the
large-batch runs, the missing-gradient runs, the trainers
(:class:`KerasTrainer`) and the hand-computed checks (:class:`KerasVectors`).
Each family's module (``keras3``, ``keras2``, ``legacy``) subclasses
:class:`KerasDriver` with its cases and its differences."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tensorflow as tf

from support.drivers.base import MISSING_MB, MISSING_N, PATTERN, SKIP_COUNTERS, Case, Driver, Inner, Run
from support.graph_deps import micro_step_ops


class KerasDriver(Driver):
    """A Keras family on TensorFlow. Subclasses set ``family``, ``N``, ``B``,
    ``UPDATES``, ``MOVED`` and define the case lists, :meth:`inner_state`,
    :meth:`save_formats` and :meth:`old_save_formats`."""

    MODE = "graph"
    # AdamW, a cosine schedule with warmup and EMA.
    RICH_INNER = Inner("adamw_ema", 1e-2)
    #: The equivalence cases also run eagerly (:meth:`mode_cases`).
    EAGER_CASES: tuple = ()
    #: Arguments of the family's ``Optimizer`` base class that belong on the
    #: inner optimizer, ``(name, value)``: refused on the wrapper.
    BASE_ARGUMENTS: tuple = (("clipnorm", 1.0), ("clipvalue", 0.5), ("global_clipnorm", 2.0), ("weight_decay", 0.01),
                             ("use_ema", True), ("ema_momentum", 0.5), ("learning_rate", 0.1))
    #: Base-class arguments at their defaults, as generic code writes them: accepted.
    BASE_DEFAULTS: dict = {"clipnorm": None, "use_ema": False, "learning_rate": None, "ema_momentum": 0.99}

    def __init__(self):
        from support import reference as R

        self.R = R
        self.keras = R.keras

    @property
    def optimizers(self):
        """The family's optimizer classes (``keras.optimizers``,
        ``tf.keras.optimizers``; the legacy family's ``.legacy``)."""
        return self.keras.optimizers

    # ----------------------------------------------------------- cases
    def equivalence_cases(self) -> list:
        """Every optimizer class of the family, and clipping and weight decay
        (the schedules and EMA have their own tests)."""
        return [Case(name, make) for name, make in sorted(self.equivalence_inners().items())]

    def equivalence_inners(self) -> dict:
        """``{name: make_inner(model)}`` of :meth:`equivalence_cases`."""
        raise NotImplementedError

    def mode_cases(self):
        """Eagerly (both runs): the optimizers whose eager and traced
        arithmetic differ the most (fused kernels vs composite ops, Nadam's
        Python-side momentum cache), and one plain case."""
        by_name = {c.name: c for c in self.equivalence_cases()}
        return [dataclasses.replace(by_name[n], name=f"{n}-eager", mode="eager") for n in self.EAGER_CASES]

    def new_api_schedule_cases(self, cosine_name: str) -> list:
        """The schedules Keras 3 and Keras 2's new API share, whose boundaries
        and decay lengths are in updates: the windows trained cross them, so a
        schedule fed micro-steps gives other rates. ``cosine_name``: the
        cosine case's name (its test id)."""
        o, schedules = self.optimizers, self.keras.optimizers.schedules
        return [
            Case("piecewise_constant", lambda m: o.Adam(schedules.PiecewiseConstantDecay([1, 2], [1e-2, 3e-2, 1e-3]))),
            Case(cosine_name, lambda m: o.AdamW(
                schedules.CosineDecay(0.0, decay_steps=3, warmup_target=2e-2, warmup_steps=2),
                weight_decay=0.05, use_ema=True)),
        ]

    def fast_schedule_pair(self):
        """A schedule and the same schedule stepped N times faster (what a
        wrapper that fed it micro-steps would apply). ExponentialDecay takes a
        float number of steps."""
        o, s = self.optimizers, self.keras.optimizers.schedules
        return (Case("ExponentialDecay", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))),
                Case("fast", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1 / self.N, decay_rate=0.5))))

    # ----------------------------------------------------------- runs
    def pair_model(self, dtype="float32", seed=0):
        """The model of the large-batch comparisons (:meth:`pair`)."""
        return self.R.make_mlp(seed, dtype=dtype)

    def pair_data(self, n, dtype="float32"):
        return self.R.make_data(n, dtype=dtype)

    def data(self, n):
        """Samples for the trainers' model (``make_mlp``: 6 -> 3)."""
        return self.R.make_data(n)

    def inner_state(self, inner) -> tuple[list, list]:
        """``(names, arrays)`` of every variable of a plain optimizer."""
        raise NotImplementedError

    def ema_shadows(self, inner, model) -> list | None:
        """The EMA shadows of Keras' ``use_ema``."""
        if not getattr(inner, "use_ema", False):
            return None
        return [np.array(v.numpy()) for v in inner._model_variables_moving_average]

    def learning_rate(self, opt) -> float | None:
        """The current learning rate the optimizer reports; ``None`` where it
        is not a plain attribute or the optimizer has none (Keras 3's
        MultiOptimizer: one per sub-optimizer)."""
        try:
            return float(np.asarray(opt.learning_rate))
        except (AttributeError, ValueError):
            return None

    def build_reference(self, opt, model):
        """Before the reference's first step (the plain optimizer); nothing
        here."""

    def reference(self, case: Case) -> Run:
        return self._run(case, accumulate=False)

    def pair(self, case: Case) -> tuple[Run, Run]:
        return self._run(case, accumulate=False), self._run(case, accumulate=True)

    def _run(self, case: Case, accumulate: bool) -> Run:
        from accum_optimizer import AccumulatingOptimizer

        n, b, updates = self.N, self.B, case.updates or self.UPDATES
        mode = case.mode or self.MODE
        x, y = self.pair_data(n * b * updates, case.dtype)
        model = self.pair_model(case.dtype)
        initial = [np.array(w.numpy()) for w in model.weights]
        inner = case.make_inner(model)
        opt = AccumulatingOptimizer(inner, n, reduction=case.reduction) if accumulate else inner
        loss = self.R.mse
        if case.reduction == "sum" and not accumulate:
            # The sum of N micro-batch mean losses has the gradient of N times the large batch's.
            loss = lambda y_, p_: self.R.mse(y_, p_) * tf.cast(float(n), p_.dtype)  # noqa: E731
        if not accumulate:
            self.build_reference(opt, model)
        step = self.R.make_train_step(model, opt, loss, mode=mode)
        trajectory = self.R.train_updates(
            step, x, y, n, b, updates, accumulate,
            record=lambda: [np.array(w.numpy()) for w in model.weights] + self.inner_state(inner)[1])
        return Run(
            trajectory=trajectory, initial=initial, n_weights=len(model.weights),
            state_names=self.inner_state(inner)[0], iterations=int(opt.iterations.numpy()),
            micro_steps=int(opt.micro_steps.numpy()) if accumulate else None,
            learning_rate=self.learning_rate(opt), ema=self.ema_shadows(inner, model),
            objects={"model": model, "opt": opt, "inner": inner},
        )

    # ----------------------------------------------- missing gradients
    def missing_gradient_inners(self) -> dict:
        """``{name: make_inner(model)}`` of :meth:`missing_gradient_cases`."""
        raise NotImplementedError

    def missing_gradient_cases(self):
        return [Case(f"{name}-{variant}", make, variant=variant)
                for name, make in sorted(self.missing_gradient_inners().items())
                for variant in ("none_grads", "variable_subset")]

    def missing_gradient_state(self, inner, model) -> tuple[list, list]:
        """``(names, arrays)`` of the inner optimizer in the missing-gradient
        runs: :meth:`inner_state`."""
        return self.inner_state(inner)

    def missing_gradient_runs(self, case):
        """``(ref, acc)``: the hand-built large batch of every window of
        :data:`PATTERN` and the accumulating run (a traced step per kind of
        micro-step); each a dict with the weights and inner state after every
        window."""
        from accum_optimizer import AccumulatingOptimizer

        R = self.R
        x, y = R.make_data(MISSING_N * len(PATTERN) * MISSING_MB, in_dim=4, out_dim=2)
        mb = MISSING_MB

        def name_of(v):
            return getattr(v, "path", None) or v.name

        def record(model, inner, out):
            out["windows"].append({"weights": [np.array(w.numpy()) for w in model.weights],
                                   "state": self.missing_gradient_state(inner, model)[1]})

        # The reference: one tape over the window's micro-batch losses.
        model = R.missing_grad_model()
        inner = case.make_inner(model)
        ref = {"windows": []}
        k = 0
        for window in PATTERN:
            with tf.GradientTape() as tape:
                losses = [R.missing_grad_loss(model, x[(k + i) * mb:(k + i + 1) * mb], y[(k + i) * mb:(k + i + 1) * mb], u)
                          for i, u in enumerate(window)]
                loss = tf.add_n(losses) / MISSING_N  # mean over the window's N*B samples
            k += MISSING_N
            grads = tape.gradient(loss, model.trainable_variables)
            assert (grads[2] is None) == (not any(window))
            inner.apply_gradients(zip(grads, model.trainable_variables))
            record(model, inner, ref)

        model = R.missing_grad_model()
        initial = [np.array(w.numpy()) for w in model.weights]
        inner = case.make_inner(model)
        opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=MISSING_N)
        opt.build(model.trainable_variables)
        a_vars = [v for v in model.trainable_variables if "branch_a" in name_of(v)]
        subset = case.variant == "variable_subset"

        def step(xb, yb, uses_b):
            with tf.GradientTape() as tape:
                loss = R.missing_grad_loss(model, xb, yb, uses_b)
            grads = tape.gradient(loss, model.trainable_variables)
            if subset and not uses_b:
                opt.apply_gradients(zip(grads[:2], a_vars))
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables))

        if (case.mode or self.MODE) != "eager":
            step = tf.function(step)

        acc = {"windows": [], "initial": initial, "weight_names": [name_of(w) for w in model.weights]}
        k = 0
        for window in PATTERN:
            for uses_b in window:
                step(tf.constant(x[k * mb:(k + 1) * mb]), tf.constant(y[k * mb:(k + 1) * mb]), uses_b)
                k += 1
            record(model, inner, acc)
        acc["state_names"] = self.missing_gradient_state(inner, model)[0]
        acc["iterations"] = int(opt.iterations.numpy())
        acc["inner_attributes"] = set(vars(inner))
        return ref, acc

    # ------------------------------------------------ MirroredStrategy
    #: ``model.fit`` under MirroredStrategy: N, the global micro-batch B,
    #: windows per epoch, epochs, and how far the reference must move the weights.
    MIRRORED = (4, 8, 3, 2, 1e-2)

    def mirrored_cases(self) -> list:
        """The inner optimizers of :meth:`mirrored_pair` (``Case.variant``:
        the model and data, :meth:`mirrored_model`)."""
        raise NotImplementedError

    def adamw_ema_schedule(self, model=None):
        """AdamW with an ExponentialDecay schedule, weight decay and EMA (a
        case of :meth:`mirrored_cases`)."""
        o = self.optimizers
        return o.AdamW(learning_rate=o.schedules.ExponentialDecay(2e-2, decay_steps=2, decay_rate=0.5),
                       weight_decay=0.05, use_ema=True, ema_momentum=0.9)

    def mirrored_model(self, case):
        return self.R.make_mlp(seed=0)

    def mirrored_data(self, case, n):
        return self.R.make_data(n)

    def mirrored_fit(self, case, x, y, batch, n=None, strategy=None):
        """``model.fit`` (``"mse"``, no shuffling, not XLA-compiled) of the
        case's model with its plain inner optimizer (``n`` None) or wrapped
        with N = ``n``, under ``strategy``'s scope if given; ``(model, inner,
        opt)``."""
        from accum_optimizer import AccumulatingOptimizer

        epochs = self.MIRRORED[3]
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = self.mirrored_model(case)
            inner = case.make_inner(model)
            opt = inner if n is None else AccumulatingOptimizer(inner, gradient_accumulation_steps=n)
            model.compile(optimizer=opt, loss="mse", jit_compile=False)
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), epochs=epochs, shuffle=False,
                      verbose=0)
        return model, inner, opt

    def mirrored_reductions(self, case, x, y, strategy, counter):
        """How many gradient all-reductions (``counter.take()``) the
        accumulating fit must make: ``None`` where it is not counted here."""
        return None

    def mirrored_pair(self, case, strategy, monkeypatch) -> tuple[Run, Run]:
        """The single-device large batch (plain inner optimizer, batch N·B) and
        the accumulating fit under ``strategy`` (micro-batches of B). The
        accumulating :class:`Run`'s ``objects`` hold ``reductions`` (the
        gradient all-reductions it made), ``expected_reductions``
        (:meth:`mirrored_reductions`) and ``replicas`` (each replica's value of
        every weight and inner variable)."""
        from support.distribution import ReductionCounter

        n, b, windows, epochs, _ = self.MIRRORED
        x, y = self.mirrored_data(case, n * b * windows)
        runs = []
        ref_model, ref_inner, _ = self.mirrored_fit(case, x, y, n * b)
        counter = ReductionCounter(monkeypatch, strategy, entry_points=("_batch_reduce_to",))
        expected = self.mirrored_reductions(case, x, y, strategy, counter)
        model, inner, opt = self.mirrored_fit(case, x, y, b, n=n, strategy=strategy)
        reductions = counter.take()
        for m, i, o in ((ref_model, ref_inner, ref_inner), (model, inner, opt)):
            names, state = self.inner_state(i)
            runs.append(Run(trajectory=[[np.array(w.numpy()) for w in m.weights] + state],
                            initial=[np.array(w.numpy()) for w in self.mirrored_model(case).weights],
                            n_weights=len(m.weights), state_names=names, iterations=int(o.iterations.numpy()),
                            micro_steps=int(o.micro_steps.numpy()) if o is opt else None))
        variables = list(model.weights) + self.optimizer_variables(inner)
        runs[1].objects.update(reductions=reductions, expected_reductions=expected,
                               replicas=[self.replica_values(v, strategy.num_replicas_in_sync) for v in variables])
        return runs[0], runs[1]

    def replica_values(self, v, replicas: int) -> list:
        """Each replica's value of a variable made under a strategy of
        ``replicas`` replicas."""
        return [np.array(c.numpy()) for c in getattr(v, "values", [v])]

    # ----------------------------------------------------------- graphs
    def sparse_step_ops(self, vocab: int, dim: int, n=None, branch: str = "else_branch") -> list:
        """The ops one micro-step runs (:func:`support.graph_deps.micro_step_ops`, ``branch`` of
        the window's ``cond``) of a traced step (``tf.function``, 8 samples)
        of ``R.table_model(vocab, dim)`` with Adam(1e-3), wrapped with N =
        ``n`` (``None``: the plain optimizer)."""
        from accum_optimizer import AccumulatingOptimizer

        model = self.R.table_model(vocab, dim)
        inner = self.optimizers.Adam(1e-3)
        opt = inner if n is None else AccumulatingOptimizer(inner, gradient_accumulation_steps=n)
        x, y = self.R.table_data(8)
        step = self.R.make_train_step(model, opt, mode="graph")
        return micro_step_ops(step.get_concrete_function(tf.constant(x), tf.constant(y)).graph, branch)

    # ------------------------------------------------------- trainers
    def make_inner(self, spec: Inner):
        o = self.optimizers
        if spec.kind == "sgd":
            return o.SGD(spec.lr, momentum=spec.momentum) if spec.momentum else o.SGD(spec.lr)
        if spec.kind == "adam":
            return o.Adam(spec.lr)
        if spec.kind == "adam_ema":
            return o.Adam(spec.lr, use_ema=True)
        if spec.kind == "rmsprop":
            return o.RMSprop(spec.lr, momentum=spec.momentum, centered=spec.centered)
        if spec.kind == "adamw_ema":
            schedule = self.keras.optimizers.schedules.CosineDecay(
                spec.lr, decay_steps=10, warmup_target=2 * spec.lr, warmup_steps=2)
            return o.AdamW(schedule, weight_decay=0.05, use_ema=True, ema_momentum=0.9)
        raise ValueError(spec)

    def trainer(self, inner: Inner, n=None, seed: int = 0, reduction: str = "mean", weighted: bool = False,
                mode: str = "graph", strategy=None, **options) -> "KerasTrainer":
        """``options``: more arguments of the AccumulatingOptimizer
        (``nonfinite=``, ``accumulator_dtype=``)."""
        return KerasTrainer(self, inner, n, seed, reduction, mode, strategy, options)

    def variable(self, value, dtype="float32"):
        return tf.Variable(np.array(value, dtype))

    def vectors(self, inits: list, inner: Inner, n, reduction: str = "mean", traced: bool = False,
                dtype: str = "float32", **options) -> "KerasVectors":
        """``dtype``: of the variables and gradients; ``options``: as for :meth:`trainer`."""
        return KerasVectors(self, inits, inner, n, reduction, traced, dtype, options)

    def modes(self) -> list:
        return ["graph"]

    def optimizer_variables(self, opt) -> list:
        """Every variable of an optimizer, in its order (``variables``)."""
        return list(opt.variables)

    def snapshot(self, model, inner) -> list:
        """Everything an update could touch: the weights, every inner
        variable and (legacy) the inner's hyperparameter variables."""
        return [np.array(w.numpy()) for w in model.weights] + self.inner_state(inner)[1] + self.hyper_state(inner)

    def hyper_state(self, inner) -> list:
        """Variables an update could touch beyond :meth:`inner_state`: none here."""
        return []


class _WindowView:
    """What the trainers and the hand-computed checks read of ``self.opt``
    alike: ``flush``, the accumulators, the non-finite skipping counters."""

    def flush(self, traced=False):
        (tf.function(self.opt.flush) if traced else self.opt.flush)()

    def acc_grads(self) -> list:
        return [np.array(a.numpy()) for a in self.opt.acc_grads]

    def skip_counters(self) -> dict:
        """The counters of the non-finite skipping policies the wrapper keeps."""
        return {name: int(getattr(self.opt, name).numpy()) for name in SKIP_COUNTERS
                if getattr(self.opt, name, None) is not None}


class KerasTrainer(_WindowView):
    """A seeded ``make_mlp`` model (6 -> 5 tanh -> 3) with a plain or an
    accumulating optimizer, and a custom-loop step: the gradient of the
    micro-batch's mean squared error, applied with ``weight`` if given.
    Traced steps take any batch size (one trace per kind of call)."""

    def __init__(self, d: KerasDriver, inner: Inner, n, seed, reduction, mode, strategy, options=None):
        from accum_optimizer import AccumulatingOptimizer

        self.d, self.n, self.strategy = d, n, strategy
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self.model = d.R.make_mlp(seed)
            self.inner = d.make_inner(inner)
            self.opt = self.inner if n is None else AccumulatingOptimizer(
                self.inner, n, reduction=reduction, **(options or {}))
        model, opt, mse = self.model, self.opt, d.R.mse

        def step(x, y, weight=None):
            with tf.GradientTape() as tape:
                loss = mse(y, model(x, training=True))
                if strategy is not None:
                    loss = loss / strategy.num_replicas_in_sync  # Keras' convention
            grads = tape.gradient(loss, model.trainable_variables)
            if weight is None:
                opt.apply_gradients(zip(grads, model.trainable_variables))
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)

        self._eager = step
        if mode == "eager" or strategy is not None:
            self._plain, self._weighted = step, step
        else:
            sig = [tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([None, 3], tf.float32)]
            self._plain = tf.function(lambda x, y: step(x, y), input_signature=sig)
            self._weighted = tf.function(step, input_signature=sig + [tf.TensorSpec([], tf.float32)])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self, x, y, weight=None):
        if weight is None:
            self._plain(tf.constant(x), tf.constant(y))
        else:
            self._weighted(tf.constant(x), tf.constant(y), tf.constant(float(weight), tf.float32))

    def replica_step(self, x_parts, y_parts):
        """Under the trainer's strategy, eagerly: replica ``r`` gets
        ``x_parts[r]`` and passes its own sample count as ``weight``."""
        s = self.strategy

        def replica_fn(xs, ys):
            self._eager(xs, ys, weight=tf.cast(tf.shape(xs)[0], tf.float32))

        def value(parts):
            return s.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

        s.run(replica_fn, args=(value(x_parts), value(y_parts)))

    def build(self):
        self.opt.build(self.model.trainable_variables)

    def weights(self) -> list:
        return [np.array(w.numpy()) for w in self.model.weights]

    def inner_state(self) -> list:
        return self.d.inner_state(self.inner)[1]

    def state_names(self) -> list:
        return self.d.inner_state(self.inner)[0]

    def snapshot(self) -> list:
        """:meth:`KerasDriver.snapshot` of the trainer's model."""
        return self.d.snapshot(self.model, self.inner)

    def counters(self) -> dict:
        opt = self.opt
        out = {"iterations": int(opt.iterations.numpy())}
        if self.n is not None:
            out["micro_steps"] = int(opt.micro_steps.numpy())
            if opt.mini_step is not None:
                out["mini_step"] = int(opt.mini_step.numpy())
                out["window_weight"] = float(opt.window_weight.numpy())
            out.update(self.skip_counters())
        return out

    def own_variables(self) -> list:
        """The wrapper's variables that are not the inner optimizer's."""
        inner_ids = {id(v) for v in self.d.optimizer_variables(self.inner)}
        return [v for v in self.d.optimizer_variables(self.opt) if id(v) not in inner_ids]

    def is_wrapper_counter(self, v) -> bool:
        return v is self.opt.micro_steps

    @property
    def grad_received(self):
        return self.opt.grad_received

    # --------------------------------------------------------- saving
    def save(self, fmt: str, directory, drop_window: bool = False):
        """The model and optimizer state in ``fmt``: ``"checkpoint"``
        (``tf.train.Checkpoint``), ``"weights"`` (``get_weights``, what Keras
        2's ``.h5`` format stores), ``"store"`` (``save_own_variables``, what
        ``.keras`` and ``.weights.h5`` call). ``drop_window``: without
        ``mini_step`` and ``window_weight`` (state saved before they existed)."""
        model, opt = self.model, self.opt
        if fmt == "checkpoint":
            assert not drop_window
            return tf.train.Checkpoint(model=model, optimizer=opt).write(str(directory / "ckpt"))
        if fmt == "weights":
            state = [np.array(v.numpy()) for v in self.d.optimizer_variables(opt)]
            if drop_window:
                assert state[-2].dtype == np.int64 and state[-1].dtype == np.float32  # mini_step, window_weight
                state = state[:-2]
            return model.get_weights(), state
        assert fmt == "store", fmt
        store = {}
        opt.save_own_variables(store)
        if drop_window:
            store = {str(i): store[str(i)] for i in range(len(store) - 2)}
        return model.get_weights(), store

    def restore(self, fmt: str, saved, drop_window: bool = False):
        """Into this trainer (built first: the restore must overwrite);
        ``drop_window`` is in what was saved."""
        model, opt = self.model, self.opt
        self.build()
        if fmt == "checkpoint":
            tf.train.Checkpoint(model=model, optimizer=opt).read(saved).assert_consumed()
        elif fmt == "weights":
            model.set_weights(saved[0])
            opt.set_weights(saved[1])
        else:
            model.set_weights(saved[0])
            opt.load_own_variables(saved[1])


class KerasVectors(_WindowView):
    """Hand-computed checks: variables with given initial values, gradients
    given per micro-step (``None``: no gradient), ``apply_gradients`` with
    ``weight``. ``traced``: the micro-step is a ``tf.function`` whose weight is
    a runtime tensor."""

    def __init__(self, d: KerasDriver, inits, inner: Inner, n, reduction, traced, dtype="float32", options=None):
        from accum_optimizer import AccumulatingOptimizer

        self.dtype = dtype
        self.variables = [d.variable(v, dtype) for v in inits]
        self.opt = AccumulatingOptimizer(d.make_inner(inner), n, reduction=reduction, **(options or {}))
        self.traced = traced
        self._fns = {}

    def apply(self, grads, weight=None, at_build=False):
        """One micro-step (``at_build``: the same here; eager code has no
        build time apart from the call)."""
        pairs_of = lambda gs: list(zip(gs, self.variables))  # noqa: E731
        grads = [None if g is None else tf.constant(np.array(g, "float32"), self.dtype) for g in grads]
        if not self.traced:
            if weight is None:
                self.opt.apply_gradients(pairs_of(grads))
            else:
                self.opt.apply_gradients(pairs_of(grads), weight=weight)
            return
        key = tuple(g is None for g in grads)
        if key not in self._fns:
            def fn(gs, w):
                self.opt.apply_gradients(pairs_of([None if m else g for g, m in zip(gs, key)]), weight=w)

            self._fns[key] = tf.function(fn)
        present = [tf.zeros([2], self.dtype) if g is None else g for g in grads]
        self._fns[key](present, tf.constant(1.0 if weight is None else weight, tf.float32))

    def build(self):
        """Build the window (the optimizer) before any micro-step."""
        self.opt.build(self.variables)

    def values(self) -> list:
        return [np.array(v.numpy()) for v in self.variables]

    def counters(self) -> dict:
        """The counters; ``None`` for a window variable not built yet."""
        opt = self.opt

        def value(v, kind):
            return None if v is None else kind(v.numpy())

        # Before the first micro-step builds it, Keras 2's wrapper has no
        # micro_steps/mini_step/window_weight attribute (Keras 3's: None).
        out = {"iterations": int(opt.iterations.numpy()),
               "micro_steps": value(getattr(opt, "micro_steps", None), int),
               "mini_step": value(getattr(opt, "mini_step", None), int),
               "window_weight": value(getattr(opt, "window_weight", None), float)}
        out.update(self.skip_counters())
        return out

    def acc_dtypes(self) -> list:
        """The accumulators' dtypes, as names (``"float32"``)."""
        return [tf.as_dtype(a.dtype).name for a in self.opt.acc_grads]
