"""The TF1 family: ``tf.compat.v1.train.Optimizer``, graph code run in a
``tf.compat.v1.Session`` (:class:`TF1Driver`, its trainer :class:`TF1Trainer`
and hand-computed checks :class:`TF1Vectors`)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from support.drivers.base import MISSING_MB, MISSING_N, PATTERN, SKIP_COUNTERS, Case, Driver, Inner, NotApplicable, Run


class TF1Driver(Driver):
    """``tf.compat.v1.train.Optimizer``: graph code, each run in its own
    ``tf.Graph`` and ``Session``; ``"v2"`` is TF2's defaults in a graph
    (resource variables, ``cond_v2``), ``"v1"`` what
    ``tf.compat.v1.disable_v2_behavior()`` gives (``RefVariable``\\ s,
    control flow v1). The model is :mod:`support.reference_tf1`'s softmax
    regression."""

    family = "tf1"
    N, B, UPDATES = 3, 4, 3
    MOVED = 1e-3
    MODE = "v2"
    RICH_INNER = Inner("adam", 0.02)
    ALL_STATE_MOVES_ON_UPDATE = True

    def __init__(self):
        from support import reference_tf1 as T

        self.T = T

    def equivalence_cases(self):
        return [Case(name, make) for name, make in self.T.INNER_OPTIMIZERS.items()
                if name != "Adam-exponential_decay"]

    def mode_cases(self):
        """The same under TF1 defaults: RefVariables and control flow v1 (the
        ``_apply_dense`` kernels, a ``tf.cond`` built in the graph itself)."""
        return [Case(f"{name}-v1", self.T.INNER_OPTIMIZERS[name], mode="v1")
                for name in ("Adam-exponential_decay", "Momentum-nesterov", "Ftrl")]

    def float64_cases(self):
        return NotApplicable("the TF1 model is float32 only (as before the reshape)")

    def sum_cases(self):
        return NotApplicable("reduction='sum' is proven bitwise against the design document's hand-written "
                             "recipe in tf1/test_semantics.py")

    def schedule_cases(self):
        # The user code: a schedule on global_step, which counts updates.
        return [Case("Adam-exponential_decay", self.T.INNER_OPTIMIZERS["Adam-exponential_decay"])]

    def fast_schedule_pair(self):
        tf1 = tf.compat.v1
        return (Case("exponential_decay", lambda gs: tf1.train.AdamOptimizer(
                    tf1.train.exponential_decay(0.05, gs, decay_steps=1, decay_rate=0.5))),
                Case("fast", lambda gs: tf1.train.AdamOptimizer(
                    tf1.train.exponential_decay(0.05, gs, decay_steps=1 / self.N, decay_rate=0.5))))

    def ema_cases(self):
        return NotApplicable("tf.compat.v1.train optimizers have no EMA (tf.train.ExponentialMovingAverage "
                             "is an op of its own, outside the optimizer)")

    def reference(self, case):
        return self._run(case, None)

    def pair(self, case):
        return self._run(case, None), self._run(case, self.N)

    def _run(self, case, n):
        updates = case.updates or self.UPDATES
        out = self.T.train_mlp(case.make_inner, n, self.N * self.B if n is None else self.B, updates,
                               reduction=case.reduction, mode=case.mode or self.MODE, every_update=True)
        names = sorted(out["trajectory"][0])
        model_names = [k for k in self.T.mlp_init() if k in names]
        state_names = [k for k in names if k not in model_names]
        trajectory = [[s[k] for k in model_names] + [s[k] for k in state_names] for s in out["trajectory"]]
        init = self.T.mlp_init()
        return Run(trajectory=trajectory, initial=[init[k] for k in model_names], n_weights=len(model_names),
                   state_names=state_names, iterations=int(out["trajectory"][-1]["global_step"]),
                   micro_steps=out["micro_steps"])

    def missing_gradient_cases(self):
        tf1 = tf.compat.v1
        inners = {"Adam": lambda gs: tf1.train.AdamOptimizer(0.05),
                  "Momentum": lambda gs: tf1.train.MomentumOptimizer(0.1, 0.9)}
        return [Case(f"{name}-{variant}", make, variant=variant)
                for name, make in sorted(inners.items()) for variant in ("none_grads", "variable_subset")]

    def missing_gradient_runs(self, case):
        """The graph version of :meth:`support.drivers.keras.KerasDriver.missing_gradient_runs`:
        ``y = a(x) + b(x)`` (dense layers as variables, b's kernel
        constrained to be non-negative), one train op per kind of micro-step
        (all four variables; b left out of the loss, so its gradient is None;
        only a's variables), and a reference whose window loss has b's term
        only for the micro-batches that use it (so in a window without b its
        gradient is None and the plain optimizer skips it, slots included)."""
        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        rng = np.random.default_rng(3)
        init = {"branch_a/kernel": rng.normal(size=(4, 2)).astype("float32"),
                "branch_a/bias": np.zeros(2, "float32"),
                "branch_b/kernel": rng.normal(size=(4, 2)).astype("float32"),
                "branch_b/bias": np.zeros(2, "float32")}
        n, mb = MISSING_N, MISSING_MB
        data = np.random.default_rng(1)
        x = data.normal(size=(n * len(PATTERN) * mb, 4)).astype("float32")
        y = data.normal(size=(n * len(PATTERN) * mb, 2)).astype("float32")

        def variables():
            nonneg = lambda w: tf.maximum(w, 0.0)  # noqa: E731
            return {name: tf1.Variable(value, name=name, constraint=nonneg if name == "branch_b/kernel" else None)
                    for name, value in init.items()}

        def loss(vs, xb, yb, uses_b):
            pa = tf.matmul(xb, vs["branch_a/kernel"]) + vs["branch_a/bias"]
            if not uses_b:
                return tf.reduce_mean(tf.square(yb - pa))
            return tf.reduce_mean(tf.square(yb - pa - tf.matmul(xb, vs["branch_b/kernel"]) - vs["branch_b/bias"]))

        def snapshot(sess, vs, inner, global_step):
            """Names and values: the model's variables; every variable of the
            inner optimizer (slots, beta powers) and global_step."""
            state = list(inner.variables()) + [global_step]
            return (list(init), [v.name for v in state],
                    {"weights": sess.run([vs[k] for k in init]), "state": sess.run(state)})

        # The reference.
        with tf.Graph().as_default(), tf1.Session() as sess:
            vs = variables()
            global_step = tf1.train.get_or_create_global_step()
            inner = case.make_inner(global_step)
            xs = [tf1.placeholder(tf.float32, [None, 4]) for _ in range(n)]
            ys = [tf1.placeholder(tf.float32, [None, 2]) for _ in range(n)]
            ops = {}
            for window in PATTERN:
                if tuple(window) not in ops:
                    window_loss = tf.add_n([loss(vs, xs[i], ys[i], u) for i, u in enumerate(window)]) / n
                    ops[tuple(window)] = inner.minimize(window_loss, global_step=global_step)
            sess.run(tf1.global_variables_initializer())
            ref = {"windows": []}
            k = 0
            for window in PATTERN:
                feed = {}
                for i in range(n):
                    feed[xs[i]], feed[ys[i]] = x[(k + i) * mb:(k + i + 1) * mb], y[(k + i) * mb:(k + i + 1) * mb]
                k += n
                sess.run(ops[tuple(window)], feed)
                ref["windows"].append(snapshot(sess, vs, inner, global_step)[2])

        # The accumulating run.
        with tf.Graph().as_default(), tf1.Session() as sess:
            vs = variables()
            global_step = tf1.train.get_or_create_global_step()
            inner = case.make_inner(global_step)
            opt = AccumulatingOptimizer(inner, n)
            xb, yb = tf1.placeholder(tf.float32, [None, 4]), tf1.placeholder(tf.float32, [None, 2])
            full = opt.minimize(loss(vs, xb, yb, True), global_step=global_step, var_list=list(vs.values()))
            if case.variant == "variable_subset":
                without_b = opt.minimize(loss(vs, xb, yb, False), global_step=global_step,
                                         var_list=[vs["branch_a/kernel"], vs["branch_a/bias"]])
            else:
                grads_and_vars = opt.compute_gradients(loss(vs, xb, yb, False), var_list=list(vs.values()))
                assert [g is None for g, _ in grads_and_vars] == [False, False, True, True]
                without_b = opt.apply_gradients(grads_and_vars, global_step=global_step)
            sess.run(tf1.global_variables_initializer())
            names, state_names, first = snapshot(sess, vs, inner, global_step)
            acc = {"windows": [], "initial": first["weights"], "weight_names": names, "state_names": state_names}
            k = 0
            for window in PATTERN:
                for uses_b in window:
                    sess.run(full if uses_b else without_b, {xb: x[k * mb:(k + 1) * mb], yb: y[k * mb:(k + 1) * mb]})
                    k += 1
                acc["windows"].append(snapshot(sess, vs, inner, global_step)[2])
            acc["iterations"] = int(sess.run(global_step))
            acc["inner_attributes"] = set()  # TF1: the inner's kernels are the family's own business
        return ref, acc

    def modes(self):
        return ["v2", "v1"]

    def trainer(self, inner: Inner, n=None, seed=0, reduction="mean", weighted=False, mode="v2", strategy=None,
                **options):
        assert strategy is None
        return TF1Trainer(self, inner, n, seed, reduction, weighted, mode, options)

    def vectors(self, inits, inner: Inner, n, reduction="mean", traced=False, dtype="float32", **options):
        return TF1Vectors(self, inits, inner, n, reduction, dtype, options)

    def make_inner(self, spec: Inner):
        tf1 = tf.compat.v1
        if spec.kind == "sgd":
            if spec.momentum:
                return tf1.train.MomentumOptimizer(spec.lr, spec.momentum)
            return tf1.train.GradientDescentOptimizer(spec.lr)
        if spec.kind == "adam":
            return tf1.train.AdamOptimizer(spec.lr)
        raise ValueError(spec)

    def data(self, n):
        """Samples for the trainers' model (the softmax regression: 4 -> 3)."""
        return self.T.mlp_data(n)

    def save_formats(self):
        return ["saver"]

    def old_save_formats(self):
        return ["saver"]


def _skip_counters(sess, opt) -> dict:
    """The counters of the non-finite skipping policies the wrapper keeps
    (read in its graph)."""
    return {name: int(sess.run(getattr(opt, name))) for name in SKIP_COUNTERS if getattr(opt, name, None) is not None}


class TF1Trainer:
    """The softmax regression of :mod:`support.reference_tf1` in its own graph
    and session, global_step, the inner optimizer, and one train op
    (``minimize(..., weight=<placeholder>)`` if ``weighted``) and, when
    accumulating, the flush op."""

    def __init__(self, d: TF1Driver, inner: Inner, n, seed, reduction, weighted, mode, options=None):
        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        T = d.T
        self.d, self.n, self.weighted = d, n, weighted
        self.graph = tf.Graph()
        with T.control_flow(mode), self.graph.as_default():
            self.mlp = T.build_mlp(T.mlp_init(seed=seed))
            self.global_step = tf1.train.get_or_create_global_step()
            self.inner = d.make_inner(inner)
            self.weight = tf1.placeholder(tf.float32, [], name="weight") if weighted else None
            if n is None:
                self.opt = self.inner
                self.train_op = self.inner.minimize(self.mlp.loss, global_step=self.global_step)
            else:
                self.opt = AccumulatingOptimizer(self.inner, n, reduction=reduction, **(options or {}))
                self.train_op = self.opt.minimize(self.mlp.loss, global_step=self.global_step, weight=self.weight)
                self.flush_op = self.opt.flush() if self.opt.mini_step is not None else None
            init = tf1.global_variables_initializer()
        self.sess = tf1.Session(graph=self.graph)
        self.sess.run(init)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sess.close()
        return False

    def step(self, x, y, weight=None):
        feed = self.mlp.feed(x, y)
        if self.weighted:
            feed[self.weight] = 1.0 if weight is None else float(weight)
        else:
            assert weight is None, "build the trainer with weighted=True"
        self.sess.run(self.train_op, feed)

    def build(self):
        pass  # the state exists from minimize on

    def flush(self, traced=False):
        self.sess.run(self.flush_op)

    def weights(self) -> list:
        return self.sess.run(list(self.mlp.variables.values()))

    def inner_state(self) -> list:
        with self.graph.as_default():  # TF1 optimizers list the variables of the default graph
            return self.sess.run(list(self.inner.variables()) + [self.global_step])

    def state_names(self) -> list:
        with self.graph.as_default():
            return [v.name for v in self.inner.variables()] + ["global_step"]

    def snapshot(self) -> list:
        return self.weights() + self.inner_state()

    def counters(self) -> dict:
        # The wrapper's state is per graph: read it with its graph as the default.
        with self.graph.as_default():
            out = {"iterations": int(self.sess.run(self.global_step))}
            if self.n is not None:
                opt = self.opt
                out["micro_steps"] = int(self.sess.run(opt.micro_steps))
                if opt.mini_step is not None:
                    out["mini_step"] = int(self.sess.run(opt.mini_step))
                    out["window_weight"] = float(self.sess.run(opt.window_weight))
                out.update(_skip_counters(self.sess, opt))
        return out

    def acc_grads(self) -> list:
        with self.graph.as_default():
            slots = [self.opt.get_slot(v, "acc_grad") for v in self.mlp.variables.values()]
            return [] if any(s is None for s in slots) else self.sess.run(slots)

    def own_variables(self) -> list:
        with self.graph.as_default():
            inner = {v.ref() for v in self.inner.variables()}
            return [v for v in self.opt.variables() if v.ref() not in inner]

    def is_wrapper_counter(self, v) -> bool:
        with self.graph.as_default():
            return v is self.opt.micro_steps

    @property
    def grad_received(self):
        """TF1's wrapper has no ``grad_received`` attribute (its window's
        variables are listed by ``accumulation_variables()``)."""
        with self.graph.as_default():
            return getattr(self.opt, "grad_received", None)

    def save(self, fmt, directory, drop_window=False):
        """A ``tf.compat.v1.train.Saver`` checkpoint of every global variable;
        ``drop_window``: without ``mini_step`` and ``window_weight``."""
        assert fmt == "saver", fmt
        with self.graph.as_default():  # a Saver runs in graph mode
            return tf.compat.v1.train.Saver(self._saved(drop_window)).save(self.sess, str(directory / "ckpt"))

    def restore(self, fmt, saved, drop_window=False):
        with self.graph.as_default():
            tf.compat.v1.train.Saver(self._saved(drop_window)).restore(self.sess, saved)

    def _saved(self, drop_window):
        if not drop_window:
            return None  # every global variable
        opt = self.opt
        return [v for v in tf.compat.v1.global_variables() if v is not opt.mini_step and v is not opt.window_weight]


class TF1Vectors:
    """Hand-computed checks in a graph: variables with given initial values,
    a placeholder per gradient, ``weight`` a ``placeholder_with_default(1.0)``;
    one train op per set of variables that have a gradient (the one with all
    of them built first: it builds the window), and the flush op."""

    def __init__(self, d: TF1Driver, inits, inner: Inner, n, reduction, dtype="float32", options=None):
        import itertools

        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        self.graph, self.dtype = tf.Graph(), dtype
        with self.graph.as_default():
            self.variables = [tf1.Variable(np.array(v, dtype), name=f"v{i}") for i, v in enumerate(inits)]
            self.global_step = tf1.train.get_or_create_global_step()
            self.grads = [tf1.placeholder(dtype, v.shape, name=f"g{i}") for i, v in enumerate(self.variables)]
            self.weight = tf1.placeholder_with_default(1.0, [], name="weight")
            self.opt = AccumulatingOptimizer(d.make_inner(inner), n, reduction=reduction, **(options or {}))
            self.ops = {}
            k = len(self.variables)
            masks = [m for r in range(k, 0, -1) for m in itertools.combinations(range(k), r)]
            for mask in masks:
                self.ops[mask] = self.opt.apply_gradients(
                    [(self.grads[i] if i in mask else None, v) for i, v in enumerate(self.variables)],
                    global_step=self.global_step, weight=self.weight)
            self.flush_op = self.opt.flush()
            init = tf1.global_variables_initializer()
        self.sess = tf1.Session(graph=self.graph)
        self.sess.run(init)

    def apply(self, grads, weight=None, at_build=False):
        """One micro-step. ``at_build``: ``weight`` is given to
        ``apply_gradients`` as a Python value, when the op is built (a new
        op, run once), instead of fed to the placeholder when it runs."""
        mask = tuple(i for i, g in enumerate(grads) if g is not None)
        if at_build:
            with self.graph.as_default():
                op = self.opt.apply_gradients(
                    [(None if g is None else tf.constant(np.array(g, self.dtype)), v)
                     for g, v in zip(grads, self.variables)], global_step=self.global_step, weight=weight)
            self.sess.run(op)
            return
        feed = {self.grads[i]: np.array(grads[i], self.dtype) for i in mask}
        if weight is not None:
            feed[self.weight] = weight
        self.sess.run(self.ops[mask], feed)

    def build(self):
        """The window is built with the train ops (in ``__init__``)."""

    def flush(self, traced=False):
        self.sess.run(self.flush_op)

    def values(self) -> list:
        return self.sess.run(self.variables)

    def counters(self) -> dict:
        with self.graph.as_default():  # the wrapper's state is per graph
            o = self.opt
            it, ms, mini, ww = self.sess.run([self.global_step, o.micro_steps, o.mini_step, o.window_weight])
            out = {"iterations": int(it), "micro_steps": int(ms), "mini_step": int(mini), "window_weight": float(ww)}
            out.update(_skip_counters(self.sess, o))
        return out

    def acc_grads(self) -> list:
        with self.graph.as_default():
            return self.sess.run([self.opt.get_slot(v, "acc_grad") for v in self.variables])

    def acc_dtypes(self) -> list:
        with self.graph.as_default():
            return [self.opt.get_slot(v, "acc_grad").dtype.base_dtype.name for v in self.variables]

