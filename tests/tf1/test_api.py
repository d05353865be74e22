"""TF1 family: dispatch, state variables, eager TF2, errors (issue 8: "What
a user writes" and point 8). (Pass-through at N = 1 and the shared
validators' messages: tests/contract/, tests/core/.)

References: the plain inner optimizer (eager, batch N*B); the messages the
family documents.
"""

from support.families import require

require("tf1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import accum_optimizer  # noqa: E402
from accum_optimizer.families.tf1 import AccumulatingOptimizer  # noqa: E402
from support.reference_tf1 import (  # noqa: E402
    assert_bitwise,
    assert_close,
    build_mlp,
    control_flow,
    mlp_data,
    mlp_init,
    mlp_loss,
)

tf1 = tf.compat.v1


# ---------------------------------------------------------------- dispatch
def test_dispatcher_returns_the_tf1_wrapper():
    """The public class given a TF1 optimizer returns the TF1 family's
    wrapper, itself a tf.compat.v1.train.Optimizer, and isinstance holds for
    the public class."""
    opt = accum_optimizer.AccumulatingOptimizer(tf1.train.AdamOptimizer(1e-3), gradient_accumulation_steps=2)
    assert type(opt) is AccumulatingOptimizer
    assert isinstance(opt, tf1.train.Optimizer)
    assert isinstance(opt, accum_optimizer.AccumulatingOptimizer)
    assert issubclass(AccumulatingOptimizer, accum_optimizer.AccumulatingOptimizer)


def test_an_unsupported_inner_names_the_tf1_family():
    with pytest.raises(TypeError, match=r"TF1 \(tf\.compat\.v1\.train\.Optimizer\).*Received: inner_optimizer=42"):
        accum_optimizer.AccumulatingOptimizer(42, 2)


# ------------------------------------------------------------------- state
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_state_is_non_trainable_global_and_made_at_graph_construction(mode):
    """After minimize (before any run): the accumulators and counters are
    global, non-trainable resource variables outside every cond (so
    global_variables_initializer and a default Saver see them), listed with
    the inner optimizer's slots by opt.variables(); TRAIN_OP holds the
    wrapper's op only (not the inner's update op from inside the cond)."""
    with control_flow(mode), tf.Graph().as_default():
        mlp = build_mlp(mlp_init())
        global_step = tf1.train.get_or_create_global_step()
        inner = tf1.train.AdamOptimizer(0.01)
        opt = AccumulatingOptimizer(inner, 2)
        train_op = opt.minimize(mlp.loss, global_step=global_step)
        own = opt.accumulation_variables()
        kernel, bias = mlp.variables["dense/kernel"], mlp.variables["dense/bias"]
        assert [v.name for v in own] == [
            "AccumulatingOptimizer/micro_steps:0", "AccumulatingOptimizer/grad_received:0",
            "dense/kernel/AccumulatingOptimizer/acc_grad:0", "dense/bias/AccumulatingOptimizer/acc_grad:0",
            "AccumulatingOptimizer/mini_step:0", "AccumulatingOptimizer/window_weight:0",
        ]
        assert opt.micro_steps is own[0] and opt.get_slot(kernel, "acc_grad") is own[2]
        assert [v.name for v in opt.variables()] == [v.name for v in own + inner.variables()]
        assert {"beta1_power:0", "dense/kernel/Adam:0", "dense/bias/Adam_1:0"} <= {v.name for v in inner.variables()}
        global_refs = {v.ref() for v in tf1.global_variables()}
        trainable_refs = {v.ref() for v in tf1.trainable_variables()}
        for v in opt.variables():
            assert v.ref() in global_refs and v.ref() not in trainable_refs, v.name
            assert not v.name.startswith("cond"), v.name
            if mode == "v1":
                assert v.op._get_control_flow_context() is None, v.name
        for v in own:
            assert "Resource" in type(v).__name__  # even next to RefVariables
        assert sorted(v.ref() for v in tf1.trainable_variables()) == sorted([kernel.ref(), bias.ref()])
        assert tf1.get_collection(tf1.GraphKeys.TRAIN_OP) == [train_op]
        assert opt.get_slot(kernel, "m") is inner.get_slot(kernel, "m")


@pytest.mark.parametrize("mode", ["v2", "v1", "eager"])
def test_fresh_state_reads_as_a_fresh_optimizer_before_the_first_run(mode):
    """A fresh optimizer's state, before any micro-step: every counter 0
    (``micro_steps``, ``mini_step``, ``grad_received``, ``window_weight``) and
    the accumulators 0, what a fresh optimizer holds (issue 17, bug 5: the
    graph's ``mini_step`` read -1, the mark of state saved before it existed).
    In a graph: after global_variables_initializer(); eagerly: after build()."""
    init = mlp_init()
    if mode == "eager":
        variables = [tf.Variable(v, name=k) for k, v in init.items()]
        opt = AccumulatingOptimizer(tf1.train.AdamOptimizer(0.01), 3)
        opt.build(variables)
        values = [v.numpy() for v in opt.accumulation_variables()]
    else:
        with control_flow(mode), tf.Graph().as_default(), tf1.Session() as sess:
            mlp = build_mlp(init)
            opt = AccumulatingOptimizer(tf1.train.AdamOptimizer(0.01), 3)
            opt.minimize(mlp.loss, global_step=tf1.train.get_or_create_global_step())
            sess.run(tf1.global_variables_initializer())
            assert int(sess.run(opt.mini_step)) == 0
            values = sess.run(opt.accumulation_variables())
    names = ["micro_steps", "grad_received", "acc_grad kernel", "acc_grad bias", "mini_step", "window_weight"]
    assert len(values) == len(names)
    for name, value in zip(names, values):
        np.testing.assert_array_equal(value, np.zeros_like(value), err_msg=name)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_slot_names_and_slots_read_through_the_wrapper_are_the_inner_optimizers(mode, tmp_path):
    """``opt.get_slot_names()`` is the inner optimizer's list and
    ``opt.get_slot(var, name)`` its slot, for every variable and name, after
    4 micro-steps (an update and a partial window) (issue 17, bug 4); an
    eager ``tf.train.Checkpoint`` still saves each slot once, under the
    inner optimizer (the layout of earlier versions)."""
    x, y = mlp_data(4 * 4)
    inner = tf1.train.AdamOptimizer(0.02)
    opt = AccumulatingOptimizer(inner, 3)
    if mode == "graph":
        with tf.Graph().as_default(), tf1.Session() as sess:
            mlp = build_mlp(mlp_init())
            train_op = opt.minimize(mlp.loss, global_step=tf1.train.get_or_create_global_step())
            sess.run(tf1.global_variables_initializer())
            for k in range(4):
                sess.run(train_op, mlp.feed(x[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]))
            variables = list(mlp.variables.values())
            names = inner.get_slot_names()
            assert names and opt.get_slot_names() == names
            for v in variables:
                for name in names:
                    assert opt.get_slot(v, name) is inner.get_slot(v, name), (v.name, name)
                    np.testing.assert_array_equal(sess.run(opt.get_slot(v, name)), sess.run(inner.get_slot(v, name)))
        return
    variables = [tf.Variable(v, name=k) for k, v in mlp_init().items()]
    var_dict = dict(zip(mlp_init(), variables))
    for k in range(4):
        xb, yb = x[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]
        opt.minimize(lambda: mlp_loss(var_dict, xb, yb), var_list=variables)
    names = inner.get_slot_names()
    assert names and opt.get_slot_names() == names
    for v in variables:
        for name in names:
            assert opt.get_slot(v, name) is inner.get_slot(v, name), (v.name, name)
    saved = tf.train.Checkpoint(variables=variables, optimizer=opt).save(str(tmp_path / "ck"))
    slots = [key for key, _ in tf.train.list_variables(saved) if "OPTIMIZER_SLOT" in key]
    assert len(slots) == len(variables) * len(names), slots
    assert all("/inner_optimizer/" in key for key in slots), slots


# ----------------------------------------------------------------- eager
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_eager_minimize_with_a_loss_callable_matches_the_large_batch(traced):
    """Eagerly (TF2), ``minimize(loss_fn, var_list, global_step)`` with TF1
    Adam and N=3, called as is or inside a tf.function: after 3 updates,
    weights and slots within 1e-5 of plain (eager) Adam on batch N*B;
    global_step counts updates; the slots exist from the first micro-step
    on."""
    n, b, updates = 3, 4, 3
    x, y = mlp_data(n * b * updates)
    init = mlp_init()

    def train(n_acc, batch):
        variables = {k: tf.Variable(v, name=k) for k, v in init.items()}
        global_step = tf.Variable(0, dtype=tf.int64, name="global_step")
        inner = tf1.train.AdamOptimizer(0.02)
        opt = inner if n_acc is None else AccumulatingOptimizer(inner, n_acc)

        def step(xb, yb):
            opt.minimize(lambda: mlp_loss(variables, xb, yb), var_list=list(variables.values()),
                         global_step=global_step)

        if traced and n_acc is not None:
            step = tf.function(step)
        for k in range(len(x) // batch):
            step(tf.constant(x[k * batch:(k + 1) * batch]), tf.constant(y[k * batch:(k + 1) * batch]))
            if k == 0 and n_acc is not None:
                assert inner.get_slot(variables["dense/kernel"], "m") is not None
                assert int(global_step.numpy()) == 0 and int(opt.micro_steps.numpy()) == 1
        slots = {f"{name}/{s}": inner.get_slot(v, s).numpy() for name, v in variables.items() for s in ("m", "v")}
        return {**{k: v.numpy() for k, v in variables.items()}, **slots, "global_step": global_step.numpy()}

    expected = train(None, n * b)
    actual = train(n, b)
    assert actual["global_step"] == updates
    assert_close(actual, expected, tol=1e-5)


def test_eager_checkpoint_mid_window_resumes_bitwise(tmp_path):
    """Eagerly, tf.train.Checkpoint of the variables, global_step and the
    wrapper after 4 micro-steps (N=3): restored into fresh objects before
    their first step (the state is created on it), the last 2 micro-steps
    give bitwise the uninterrupted result."""
    x, y = mlp_data(6 * 4)
    init = mlp_init()

    def objects():
        variables = {k: tf.Variable(v, name=k) for k, v in init.items()}
        global_step = tf.Variable(0, dtype=tf.int64)
        opt = AccumulatingOptimizer(tf1.train.AdamOptimizer(0.02), 3)
        ckpt = tf.train.Checkpoint(kernel=variables["dense/kernel"], bias=variables["dense/bias"],
                                   global_step=global_step, optimizer=opt)
        return variables, global_step, opt, ckpt

    def step(variables, global_step, opt, k):
        xb, yb = x[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]
        opt.minimize(lambda: mlp_loss(variables, xb, yb), var_list=list(variables.values()), global_step=global_step)

    def state(variables, global_step, opt):
        # By position: eager slot names get a counter suffix per optimizer.
        return {str(i): v.numpy() for i, v in enumerate([*variables.values(), global_step, *opt.variables()])}

    variables, global_step, opt, ckpt = objects()
    for k in range(4):
        step(variables, global_step, opt, k)
    path = ckpt.save(str(tmp_path / "eager"))
    for k in range(4, 6):
        step(variables, global_step, opt, k)
    expected = state(variables, global_step, opt)

    variables, global_step, opt, ckpt = objects()
    ckpt.restore(path)
    step(variables, global_step, opt, 4)
    assert int(opt.micro_steps.numpy()) == 5
    step(variables, global_step, opt, 5)
    actual = state(variables, global_step, opt)
    assert_bitwise(actual, expected)


def test_bad_inner_and_keyword_arguments_are_named():
    with pytest.raises(TypeError, match=r"TF1 optimizer instance.*Received: inner_optimizer='adam' of type builtins.str"):
        AccumulatingOptimizer("adam", 2)
    nested = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2)
    with pytest.raises(ValueError, match=r"already an AccumulatingOptimizer \(gradient_accumulation_steps=2\)"):
        AccumulatingOptimizer(nested, 3)
    with pytest.raises(ValueError, match=r"does not take `use_locking` \(received use_locking=True\)"):
        AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2, use_locking=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): clipnorm=1.0\. Accepted:"):
        AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2, clipnorm=1.0)
    with pytest.raises(AttributeError, match=r"`gradient_accumulation_steps` is read-only"):
        nested.gradient_accumulation_steps = 4
    with pytest.raises(ValueError, match=r"`name` must be a non-empty string or None\. Received: name=''"):
        AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2, name="")


def test_bad_gradients_are_named():
    with tf.Graph().as_default():
        v = tf1.Variable(np.zeros(2, "float32"), name="v")
        w = tf1.Variable(np.zeros(2, "float32"), name="w")
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2)
        with pytest.raises(ValueError, match=r"Gradient shape \(3,\) does not match the shape \(2,\) of variable 'v'"):
            opt.apply_gradients([(tf.ones([3]), v)])
        with pytest.raises(ValueError, match=r"No gradients provided for any variable: \['v:0', 'w:0'\]"):
            opt.apply_gradients([(None, v), (None, w)])
        with pytest.raises(ValueError, match=r"lists a variable more than once"):
            opt.apply_gradients([(tf.ones([2]), v), (tf.ones([2]), v)])
        with pytest.raises(ValueError, match=r"No variables provided"):
            opt.apply_gradients([])
        with pytest.raises(TypeError, match=r"must pair each gradient with a tf.Variable"):
            opt.apply_gradients([(tf.ones([2]), tf.ones([2]))])
        with pytest.raises(TypeError, match=r"must be \(gradient, variable\) pairs"):
            opt.apply_gradients([tf.ones([2])])
        with pytest.raises(TypeError, match=r"`var_list` must hold tf.Variable objects"):
            opt.build([tf.ones([2])])
        with pytest.raises(ValueError, match=r"`sparse_var_list` must be a subset of `var_list`"):
            opt.build([v], sparse_var_list=[w])


def test_a_distribution_strategy_is_refused():
    """tf.distribute in TF1 graph code is out of scope: a clear
    NotImplementedError, not a crash inside the update's cond."""
    with tf.Graph().as_default():
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            v = tf1.Variable(1.0, name="v")
            opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2)
            with pytest.raises(NotImplementedError, match=r"does not support tf\.distribute strategies \(called under OneDeviceStrategy"):
                opt.apply_gradients([(tf.constant(1.0), v)])
