"""The saved layouts (accum_optimizer.core.layout), framework-free: each
family's declared order, and which layout saved arrays were written in.

The "variables" are plain records with a shape and a dtype; the expected
layouts are written out by hand from the declaration (required blocks, then
the optional blocks kept, in order)."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from accum_optimizer.core import layout


def var(name, shape, dtype):
    return types.SimpleNamespace(name=name, shape=shape, dtype=np.dtype(dtype))


def keras3_blocks(trackers=2):
    """A Keras 3 wrapper over 2 variables, Adam inside, skip_window."""
    return {
        "own": [var("micro_steps", (), "int64"), var("grad_received", (2,), "int64"),
                var("acc_0", (3, 4), "float32"), var("acc_1", (4,), "float32")],
        "inner": [var("iterations", (), "int64"), var("lr", (), "float32"), var("m_0", (3, 4), "float32"),
                  var("m_1", (4,), "float32")],
        "nonfinite": [var("skipped_micro_steps", (), "int64"), var("skipped_windows", (), "int64"),
                      var("window_poisoned", (), "int64")],
        "window": [var("mini_step", (), "int64"), var("window_weight", (), "float32")],
        "trackers": [var(f"rows_{i}", (3 + i,), "float16") for i in range(trackers)],
    }


def arrays(variables):
    return [np.zeros(v.shape, v.dtype) for v in variables]


def test_ordered_is_the_declared_order():
    blocks = keras3_blocks()
    names = [v.name for v in layout.ordered(layout.LAYOUTS["keras3"], blocks)]
    assert names == [v.name for b in ("own", "inner", "nonfinite", "window", "trackers") for v in blocks[b]]


@pytest.mark.parametrize("family", sorted(layout.LAYOUTS))
def test_fitting_finds_every_older_layout(family):
    spec = layout.LAYOUTS[family]
    blocks = {name: keras3_blocks()[name] for name in spec.blocks}
    required = [v for b in spec.blocks if b not in spec.optional for v in blocks[b]]
    for keep in itertools.product((True, False), repeat=len(spec.optional)):
        expected = required + [v for k, b in zip(keep, spec.optional) if k for v in blocks[b]]
        assert layout.fitting(spec, blocks, arrays(expected)) == expected, keep


def test_fitting_tells_layouts_of_one_length_apart_by_dtype_kind():
    # Three trackers (float16) and three skip counters (int64): a save with
    # the counters but no trackers and one with the trackers but no counters
    # have the same length; the arrays' kinds say which.
    spec, blocks = layout.LAYOUTS["keras3"], keras3_blocks(trackers=3)
    blocks["trackers"] = [var(f"rows_{i}", (), "float16") for i in range(3)]
    base = blocks["own"] + blocks["inner"]
    with_counters = base + blocks["nonfinite"] + blocks["window"]
    with_trackers = base + blocks["window"] + blocks["trackers"]
    assert len(with_counters) == len(with_trackers)
    assert layout.fitting(spec, blocks, arrays(with_counters)) == with_counters
    assert layout.fitting(spec, blocks, arrays(with_trackers)) == with_trackers


def test_fitting_of_no_layout_gives_every_variable_for_the_caller_to_refuse():
    spec, blocks = layout.LAYOUTS["keras2"], {b: keras3_blocks()[b] for b in ("own", "inner", "window")}
    assert layout.fitting(spec, blocks, arrays(blocks["own"])) == layout.ordered(spec, blocks)


def test_optional_blocks_must_trail():
    with pytest.raises(ValueError, match="trailing"):
        layout.Layout(("own", "window", "inner"), ("window",))


# ------------------------------------------------------------------ build
SHAPES = [(3, 4), (4,), ()]  # a kernel, a bias, a scalar
SKIP = ["skipped_micro_steps", "skipped_windows", "window_poisoned"]


def names(specs):
    return [s.name if s.index is None else f"{s.name}_{s.index}" for s in specs]


@pytest.mark.parametrize("family, expected", [
    # Each family's build order, written out by hand (each block's saved
    # order is the one earlier versions saved: own, then the optional blocks):
    ("keras3", ["grad_received", "acc_grad_0", "acc_grad_1", "acc_grad_2", "touched_rows_0", "touched_rows_1",
                *SKIP, "mini_step", "window_weight"]),
    ("keras2", ["micro_steps", "grad_received", "acc_grad_0", "acc_grad_1", "acc_grad_2", *SKIP,
                "mini_step", "window_weight"]),
    ("legacy", ["micro_steps", "grad_received", "acc_grad_0", "acc_grad_1", "acc_grad_2", "touched_rows_0",
                "touched_rows_1", *SKIP, "mini_step", "window_weight"]),
    ("tf1", ["micro_steps", "grad_received", "acc_grad_0", "acc_grad_1", "acc_grad_2", "touched_rows_0",
             "mini_step", "window_weight", *SKIP]),
])
def test_window_specs_are_each_familys_build_order(family, expected):
    specs = layout.window_specs(layout.BUILDS[family], SHAPES, SKIP, sparse=frozenset({0, 2}))
    assert names(specs) == expected


@pytest.mark.parametrize("family", sorted(layout.LAYOUTS))
def test_every_window_variable_is_saved_in_a_block_of_the_familys_layout(family):
    specs = layout.window_specs(layout.BUILDS[family], SHAPES, SKIP)
    assert {s.block for s in specs} <= set(layout.LAYOUTS[family].blocks) - {"inner"}
    # Counters one value for all replicas; accumulators, trackers and the count per replica.
    assert {s.name for s in specs if s.replica_local} == {"acc_grad", "touched_rows", "window_weight"} & {
        s.name for s in specs}


def test_without_accumulation_only_micro_steps_is_made():
    assert names(layout.window_specs(layout.BUILDS["keras2"], SHAPES, [], accumulates=False)) == ["micro_steps"]
    assert layout.window_specs(layout.BUILDS["keras3"], SHAPES, [], accumulates=False) == []


def test_collect_places_per_variable_state_by_position():
    specs = layout.window_specs(layout.BUILDS["tf1"], SHAPES, [], sparse=frozenset({1}))
    state = layout.collect(specs, [f"v{i}" for i in range(len(specs))], len(SHAPES))
    assert state["acc_grad"] == ["v2", "v3", "v4"] and state["touched_rows"] == [None, "v5", None]
    assert state["blocks"]["window"] == [state["mini_step"], state["window_weight"]]
