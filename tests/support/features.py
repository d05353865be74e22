"""The feature x family table, and the tests that back each cell.

One :class:`Feature` per row; each family's cell is the test that proves it
(``"path/to/test_file.py::test_name"``, relative to ``tests/``; in the
legacy column ``"tfa:..."`` when the test's tensorflow-addons parameter
proves it: the legacy family has no such option of its own), or
:class:`NA` where the framework itself has no such thing, or :class:`Missing`
where the library lacks it. ``docs/features.md`` shows the table between
its markers, rendered from this list (``tests/core/test_feature_table.py``
fails when they disagree; rewrite it with
``python tests/support/features.py --write docs/features.md``).

Every cell that claims "yes" must be backed by a test that PASSED for that
family in some leg of ``make test``: each leg writes the family-marked tests
that passed (``ACCUM_PASSED_OUT``, ``tests/conftest.py``), and ``make test``
ends with ``python tests/support/features.py --check FILE...`` over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

FAMILIES = ("keras3", "keras2", "legacy", "tf1")
HEADERS = {"keras3": "Keras 3 (TF)", "keras2": "Keras 2 new API", "legacy": "legacy / tfa", "tf1": "TF1"}
BEGIN, END = "<!-- feature-table:begin -->", "<!-- feature-table:end -->"


@dataclasses.dataclass(frozen=True)
class NA:
    """The framework has no such thing (the reason is shown)."""

    why: str


@dataclasses.dataclass(frozen=True)
class Missing:
    """The library lacks it in this family (the reason is shown)."""

    why: str


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    cells: dict  # family -> test reference | NA | Missing


def _contract(module: str, test: str) -> dict:
    """The same contract test proves the cell of every family."""
    return {f: f"contract/{module}::{test}" for f in FAMILIES}


NO_FIT = NA("no `fit`: graph code passes `weight=` to `minimize`/`apply_gradients`")
NO_STRATEGY = NA("TF1 graph code runs in a `Session` without a `tf.distribute` strategy (refused: "
                 "`tf1/test_api.py::test_a_distribution_strategy_is_refused`)")

FEATURES = [
    Feature("batch-N·B equivalence, every optimizer class",
            _contract("test_large_batch.py", "test_every_optimizer_matches_the_large_batch")),
    Feature("nothing moves between updates (weights, slots, counters)",
            _contract("test_between_updates.py",
                      "test_non_update_micro_steps_leave_weights_and_inner_state_bitwise_untouched")),
    Feature("learning-rate schedules count updates",
            _contract("test_schedules.py", "test_learning_rate_schedule_counts_updates")),
    Feature("EMA moves once per update", {
        **_contract("test_ema.py", "test_ema_moves_once_per_update"),
        "legacy": "tfa:contract/test_ema.py::test_ema_moves_once_per_update",
        "tf1": NA("`tf.compat.v1.train` optimizers have no EMA (`tf.train.ExponentialMovingAverage` is an op "
                  "of its own, outside the optimizer)"),
    }),
    Feature("missing gradients: no update, decay or constraint",
            _contract("test_missing_gradients.py", "test_a_variable_without_gradient_in_a_window_is_not_updated")),
    Feature("pass-through at N = 1", _contract("test_pass_through.py", "test_n_equal_1_is_the_plain_inner_optimizer_bitwise")),
    Feature("weighted windows (`weight=`)",
            _contract("test_weighted_windows.py",
                      "test_unequal_micro_batches_weighted_by_their_counts_equal_their_concatenation")),
    Feature("`flush()` of a partial window", _contract("test_flush.py", "test_flush_normalises_by_what_the_window_holds")),
    Feature("resume mid-window from a checkpoint",
            _contract("test_resume.py", "test_resume_mid_window_after_a_flush_is_bitwise_the_uninterrupted_run")),
    Feature("`CountedLoss` (weighted windows) in `fit`", {
        "keras3": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "keras2": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "legacy": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "tf1": NO_FIT,
    }),
    Feature("`FlushPartialWindow` in `fit`", {
        "keras3": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "keras2": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "legacy": "contract/test_fit_windows.py::test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch",
        "tf1": NO_FIT,
    }),
    Feature("accumulation schedules (dict / callable)", {
        **_contract("test_schedules.py", "test_dict_schedule_equals_growing_large_batches"),
    }),
    Feature("`nonfinite` policies (`skip_micro_step`, `skip_window`)", {
        **_contract("test_nonfinite.py", "test_skip_micro_step_equals_the_large_batch_of_the_finite_micro_batches"),
    }),
    Feature("`accumulator_dtype` (float32 accumulators for 16-bit variables)", {
        **_contract("test_nonfinite.py", "test_float16_variables_accumulate_in_float32_and_cast_once_per_update"),
    }),
    Feature("sparse windows (embeddings: scatter-add, never dense)", {
        "keras3": "contract/test_sparse.py::test_micro_step_graph_scatter_adds_and_never_densifies_a_large_table",
        "keras2": "contract/test_sparse.py::test_micro_step_graph_scatter_adds_and_never_densifies_a_large_table",
        "legacy": "legacy/test_sparse.py::test_micro_step_scatter_adds_and_never_densifies",
        "tf1": "tf1/test_semantics.py::test_sparse_gradients_are_scatter_added_never_densified",
    }),
    Feature("`MirroredStrategy` equals the single-device large batch", {
        "keras3": "contract/test_mirrored.py::test_mirrored_fit_matches_single_device_large_batch",
        "keras2": "contract/test_mirrored.py::test_mirrored_fit_matches_single_device_large_batch",
        "legacy": "contract/test_mirrored.py::test_mirrored_fit_matches_single_device_large_batch",
        "tf1": NO_STRATEGY,
    }),
    Feature("`MultiWorkerMirroredStrategy`, one all-reduce per update", {
        "keras3": "keras3/test_multiworker.py::test_one_gradient_all_reduce_per_update_per_worker",
        "keras2": "keras2/test_multiworker.py::test_one_gradient_all_reduce_per_update_per_worker",
        "legacy": "keras2/test_multiworker.py::test_one_gradient_all_reduce_per_update_per_worker",
        "tf1": NO_STRATEGY,
    }),
    Feature("refusal of strategies that cannot be served (`ParameterServerStrategy`, `CentralStorageStrategy`)", {
        "keras3": "contract/test_strategies.py::test_central_storage_strategy_is_refused_at_construction_and_at_build",
        "keras2": "contract/test_strategies.py::test_central_storage_strategy_is_refused_at_construction_and_at_build",
        "legacy": "contract/test_strategies.py::test_central_storage_strategy_is_refused_at_construction_and_at_build",
        "tf1": "tf1/test_api.py::test_a_distribution_strategy_is_refused",
    }),
    Feature("the inner's hyperparameters and clip settings, read and assigned through the wrapper", {
        "keras3": "keras3/test_api.py::test_settings_of_the_inner_optimizer_are_read_and_assigned_through_the_wrapper",
        "keras2": "keras2/test_api.py::test_settings_of_the_inner_optimizer_are_read_and_assigned_through_the_wrapper",
        "legacy": "legacy/test_semantics.py::"
                  "test_hyperparameters_and_clip_settings_are_read_and_assigned_through_the_wrapper",
        "tf1": NA("`tf.compat.v1.train` optimizers keep their hyperparameters private (`_lr`, `_beta1`) and have "
                  "no clip settings"),
    }),
    Feature("`tf.compat.v1` graph code: `sess.run` the returned train op", {
        "keras3": NA("Keras 3 runs eagerly or in `tf.function`: it has no `tf.compat.v1` graph mode"),
        "keras2": NA("Keras 2's new-API optimizers do not update in a `tf.compat.v1` graph (the op the plain one "
                     "returns does not depend on its updates): TF1-style code uses the legacy optimizers"),
        "legacy": "legacy/test_graph_mode.py::test_train_op_in_a_v1_graph_trains_like_the_plain_optimizer",
        "tf1": "tf1/test_semantics.py::test_window_phase_by_hand",
    }),
    Feature("BatchNorm's moving statistics once per window, equal to the large batch's "
            "(`accum_optimizer.layers.BatchNormalization`)", {
        "keras3": "contract/test_batch_norm.py::test_moving_statistics_equal_the_large_batch_after_every_window",
        "keras2": "contract/test_batch_norm.py::test_moving_statistics_equal_the_large_batch_after_every_window",
        "legacy": "contract/test_batch_norm.py::test_moving_statistics_equal_the_large_batch_after_every_window",
        "tf1": NA("TF1 graph code has no Keras BatchNormalization layer of its own (`tf.compat.v1.layers` "
                  "batch normalization updates through UPDATE_OPS, outside the optimizer)"),
    }),
    Feature("float8 training (`model.quantize(\"float8\")`): scales and amax histories once per window, "
            "equal to the large batch's", {
        "keras3": "backends/test_float8_any_backend.py::test_one_window_float8_state_is_bitwise_the_large_batch_s",
        "keras2": NA("Keras 2 has no float8 layers (`overwrite_with_gradient` variables are Keras 3's)"),
        "legacy": NA("Keras 2 has no float8 layers (`overwrite_with_gradient` variables are Keras 3's)"),
        "tf1": NA("TF1 graph code has no float8 layers"),
    }),
    Feature("checkpoints saved by earlier versions resume bitwise", {
        "keras3": "contract/test_saved_checkpoints.py::test_resumes_saved_checkpoint_bitwise",
        "keras2": "contract/test_saved_checkpoints.py::test_resumes_saved_checkpoint_bitwise",
        "legacy": "contract/test_saved_checkpoints.py::test_resumes_saved_checkpoint_bitwise",
        "tf1": "contract/test_saved_checkpoints.py::test_resumes_saved_checkpoint_bitwise",
    }),
]


def _cell(value) -> str:
    if isinstance(value, NA):
        return "n/a"
    if isinstance(value, Missing):
        return "**no**"
    return "yes"


def _proof(feature: Feature) -> str:
    """The last column: the test of the "yes" cells (one, or one per family),
    and the reason of every other cell."""
    refs = {f: v for f, v in feature.cells.items() if isinstance(v, str)}
    parts = []
    if len(set(refs.values())) == 1:
        parts.append(f"`{next(iter(refs.values()))}`")
    else:
        parts += [f"{HEADERS[f]}: `{ref}`" for f, ref in refs.items()]
    parts = [p.replace("`tfa:", "tensorflow-addons: `") for p in parts]
    parts += [f"{HEADERS[f]}: {_cell(v)}, {v.why}" for f, v in feature.cells.items() if not isinstance(v, str)]
    return "<br>".join(parts)


def render() -> str:
    """The markdown table (without the markers)."""
    lines = ["| feature | " + " | ".join(HEADERS[f] for f in FAMILIES) + " | proved by (tests/…) |",
             "|---" * (len(FAMILIES) + 2) + "|"]
    for feature in FEATURES:
        cells = " | ".join(_cell(feature.cells[f]) for f in FAMILIES)
        lines.append(f"| {feature.name} | {cells} | {_proof(feature)} |")
    return "\n".join(lines)


def section(text: str) -> str:
    """What stands between the markers of a page."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write(page: pathlib.Path) -> None:
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:start] + "\n" + render() + "\n" + text[end:])


def claims() -> list:
    """``(family marker, test reference)`` of every "yes" cell."""
    out = []
    for feature in FEATURES:
        for f in FAMILIES:
            ref = feature.cells[f]
            if isinstance(ref, str):
                marker, _, rest = ref.partition(":") if ref.startswith("tfa:") else (f, "", ref)
                out.append((marker, rest))
    return out


def unbacked(passed_lines: set) -> list:
    """The claims no leg's passed tests back. A passed line is
    ``"<family marker> tests/<ref>"`` (``tests/conftest.py``)."""
    return [(f, ref) for f, ref in claims() if f"{f} tests/{ref}" not in passed_lines]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=pathlib.Path, help="rewrite the table in this page")
    parser.add_argument("--check", nargs="*", type=pathlib.Path, default=None,
                        help="the legs' passed-test files: fail if a 'yes' cell is backed by none")
    args = parser.parse_args(argv)
    if args.write:
        write(args.write)
        print(f"wrote the feature table ({len(FEATURES)} rows) into {args.write}")
    if args.check is not None:
        passed = set()
        for path in args.check:
            if path.is_file():
                passed |= set(path.read_text().split("\n"))
            else:
                print(f"feature table: {path} is missing (its leg did not run to the end)")
        missing = unbacked(passed)
        for f, ref in missing:
            print(f"feature table: the {f} cell names tests/{ref}, which passed for {f} in no leg")
        print(f"feature table: {len(claims()) - len(missing)} of {len(claims())} 'yes' cells backed by "
              f"a test that passed ({len(args.check)} legs)")
        return 1 if missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
