"""TF1 graph code with gradient accumulation: Session, placeholders, global_step.

A two-layer network written with ``tf.compat.v1`` ops (placeholders,
``tf.compat.v1.Variable``, ``matmul``, softmax cross-entropy) is trained on
scikit-learn's bundled 8x8 digits (1,797 images shipped with scikit-learn;
nothing is downloaded) twice, from the same initial weights and in the same
sample order:

1. ``plain``: batch ``micro_batch * steps`` with ``AdamOptimizer``;
2. ``accum``: micro-batch ``micro_batch`` with
   ``AccumulatingOptimizer(AdamOptimizer, steps)``: one ``sess.run(train_op)``
   per micro-batch, every ``steps``-th one updates the weights.

The learning rate is ``exponential_decay`` on ``global_step``; with the
wrapper ``global_step`` counts updates, so both runs see the same schedule.
The script prints both final losses (mean cross-entropy over the training
set), test accuracies, ``global_step``, and the max absolute weight difference
between the runs, and exits with status 1 if that difference exceeds
``--tolerance``.

    python examples/tf1_session.py [--epochs 3] [--micro-batch 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SEED = 1234
HIDDEN = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Trains a small tf.compat.v1 graph on sklearn's digits with "
        "AccumulatingOptimizer at micro-batch B x N steps and, for reference, "
        "plainly with batch N*B, and compares the weights.",
        epilog="Exit status 0 if the two runs' weights agree within --tolerance, "
        "1 if they do not.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=3, help="epochs per run")
    p.add_argument("--micro-batch", type=int, default=8, help="micro-batch size B of the accumulating run")
    p.add_argument("--steps", type=int, default=4,
                   help="gradient_accumulation_steps N; the plain run's batch is B*N")
    p.add_argument("--lr", type=float, default=1e-2, help="initial Adam learning rate")
    p.add_argument("--decay-rate", type=float, default=0.99,
                   help="exponential_decay rate per update (global_step)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest max-abs weight difference (float32) allowed between the runs")
    p.add_argument("--tf1-behavior", action="store_true",
                   help="call tf.compat.v1.disable_v2_behavior() first (RefVariables, "
                   "control flow v1), as TF1-era programs do")
    args = p.parse_args(argv)
    for flag, value in (("--epochs", args.epochs), ("--micro-batch", args.micro_batch), ("--steps", args.steps)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.tolerance < 0:
        p.error(f"--tolerance must be >= 0, got {args.tolerance}")
    return args


def load_digits_split():
    """Standardised digits: 1,280 training samples (a multiple of most batch
    sizes), the rest for testing."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = np.eye(10, dtype="float32")[digits.target]
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1280], y[:1280]), (x[1280:], y[1280:])


def initial_weights():
    import numpy as np

    rng = np.random.default_rng(SEED)
    return {
        "dense1/kernel": (rng.normal(size=(64, HIDDEN)) * np.sqrt(2 / 64)).astype("float32"),
        "dense1/bias": np.zeros(HIDDEN, "float32"),
        "dense2/kernel": (rng.normal(size=(HIDDEN, 10)) * np.sqrt(1 / HIDDEN)).astype("float32"),
        "dense2/bias": np.zeros(10, "float32"),
    }


def train(args, accumulate: bool, train_data, test_data) -> dict:
    """Train one run in its own graph; return its weights and figures."""
    import numpy as np
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    tf1 = tf.compat.v1
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    n = args.steps
    batch = args.micro_batch if accumulate else args.micro_batch * n
    with tf.Graph().as_default(), tf1.Session() as sess:
        x = tf1.placeholder(tf.float32, [None, 64], name="x")
        y = tf1.placeholder(tf.float32, [None, 10], name="y")
        w = {name: tf1.Variable(value, name=name) for name, value in initial_weights().items()}
        h = tf.nn.relu(tf.matmul(x, w["dense1/kernel"]) + w["dense1/bias"])
        logits = tf.matmul(h, w["dense2/kernel"]) + w["dense2/bias"]
        loss = tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(labels=y, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), tf.argmax(y, 1)), tf.float32))

        global_step = tf1.train.get_or_create_global_step()
        lr = tf1.train.exponential_decay(args.lr, global_step, decay_steps=1, decay_rate=args.decay_rate)
        opt = tf1.train.AdamOptimizer(lr)
        if accumulate:
            opt = AccumulatingOptimizer(opt, gradient_accumulation_steps=n)
        train_op = opt.minimize(loss, global_step=global_step)

        sess.run(tf1.global_variables_initializer())
        order = np.random.default_rng(SEED + 1)
        runs, start = 0, time.perf_counter()
        for _ in range(args.epochs):
            perm = order.permutation(len(x_train))
            # Both runs visit the samples in the same order: the plain run's
            # batch k is the accumulating run's micro-batches k*N .. k*N+N-1.
            for i in range(0, len(perm) - batch + 1, batch):
                idx = perm[i:i + batch]
                sess.run(train_op, {x: x_train[idx], y: y_train[idx]})
                runs += 1
        seconds = time.perf_counter() - start
        final_loss = sess.run(loss, {x: x_train, y: y_train})
        test_acc = sess.run(accuracy, {x: x_test, y: y_test})
        return {
            "weights": sess.run(w),
            "loss": float(final_loss),
            "test_acc": float(test_acc),
            "global_step": int(sess.run(global_step)),
            "runs": runs,
            "seconds": seconds,
        }


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import tensorflow as tf

    if args.tf1_behavior:
        tf.compat.v1.disable_v2_behavior()
    if 1280 % (args.micro_batch * args.steps):
        print(f"note: 1280 training samples are not a multiple of B*N = {args.micro_batch * args.steps}; "
              "each epoch drops the remainder in both runs", file=sys.stderr)
    train_data, test_data = load_digits_split()
    plain = train(args, accumulate=False, train_data=train_data, test_data=test_data)
    accum = train(args, accumulate=True, train_data=train_data, test_data=test_data)
    diff = max(float(np.max(np.abs(accum["weights"][k] - plain["weights"][k]))) for k in plain["weights"])

    print(f"TensorFlow {tf.__version__}; {args.epochs} epochs; N={args.steps}, B={args.micro_batch}"
          + ("; tf1 behavior (disable_v2_behavior)" if args.tf1_behavior else ""))
    print(f"{'run':<28}{'sess.run':>9}{'global_step':>12}{'final loss':>12}{'test acc':>10}{'s':>7}")
    for name, r in ((f"plain, batch {args.micro_batch * args.steps}", plain),
                    (f"accum, micro-batch {args.micro_batch} x {args.steps}", accum)):
        print(f"{name:<28}{r['runs']:>9}{r['global_step']:>12}{r['loss']:>12.6f}{r['test_acc']:>10.4f}"
              f"{r['seconds']:>7.1f}")
    print(f"max |weight difference|: {diff:.3e} (tolerance {args.tolerance:g})")
    if not diff <= args.tolerance:
        print("FAIL: the accumulating run drifted from the large-batch reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
