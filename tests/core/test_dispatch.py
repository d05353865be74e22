"""Which family an inner optimizer belongs to: the family tests of the
dispatcher do not overlap (whichever Keras this leg has).

Reference: the optimizers' own classes (a TF1 ``tf.compat.v1.train``
optimizer, the active ``tf.keras`` optimizer).
"""

from support.families import require

require("tf1")

import tensorflow as tf  # noqa: E402

from support import internals  # noqa: E402

tf1 = tf.compat.v1


def test_tf1_and_keras_families_do_not_overlap():
    """No Keras family test matches a TF1 optimizer and the TF1 test matches
    no Keras optimizer."""
    tf1_opt = tf1.train.MomentumOptimizer(0.1, 0.9)
    assert internals._is_tf1(tf1_opt)
    assert not internals._is_keras3(tf1_opt)
    assert not internals._is_keras2(tf1_opt) and not internals._is_legacy(tf1_opt)
    assert internals.family_of(tf1.train.GradientDescentOptimizer(0.1)).module == "tf1"
    keras_opt = tf.keras.optimizers.SGD(0.1)
    assert not internals._is_tf1(keras_opt)
    try:
        family = internals.family_of(keras_opt).module
    except TypeError:  # a leg whose Keras family is not registered (yet)
        family = None
    assert family != "tf1"
