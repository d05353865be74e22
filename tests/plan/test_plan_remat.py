"""Rematerialisation as the planner's third choice on TensorFlow
(``remat=``): each ``keras.RematScope`` mode gets its own search in fresh
probe processes, and the plan is the candidate (B, mode, N) that trains the
most samples per second at the target. (On JAX: ``test_plan_jax.py``.)

References: independent fresh-process probes of the same model at the same
B with and without the scope (the memory remat saves, measured apart from
the plan); the formula ``samples/s = T / (N * seconds_per_micro_step)`` over
the candidates' own figures; hand-written values for the validation and the
error summary. The model (``tests/support/plan_remat.py``) is a deep MLP of
wide GELU layers: its activations fill the budget, and ``"activations"``
mode recomputes the GELU outputs in the backward pass.
"""

from support.families import require

require("keras3")

import pytest  # noqa: E402

from accum_optimizer.plan import Plan, _check_remat, _error_summary, plan_accumulation, probe  # noqa: E402

BUILD, BATCH = "support.plan_remat:build", "support.plan_remat:batch"
TARGET = 4096


def test_remat_is_refused_where_the_planner_cannot_measure_it():
    assert _check_remat(True, "tensorflow") == ("full", "activations") == _check_remat(True, "jax")
    assert _check_remat(["activations", "activations"], "tensorflow") == ("activations",)
    assert _check_remat(False, "torch") == () == _check_remat(None, "torch")
    with pytest.raises(ValueError, match=r"`remat` is planned on JAX and TensorFlow; this is Keras on torch.*"
                                         r"Received: remat=True"):
        _check_remat(True, "torch")
    for bad in ("list_of_layers", [], ["full", None], 1):
        with pytest.raises(ValueError, match=r"`remat` must be True, False, None, or one or more of "
                                             r"\('full', 'activations'\).*Received: remat="):
            _check_remat(bad, "tensorflow")


def test_a_mode_keras_cannot_apply_is_summarised_by_its_exception():
    """The shape of Keras 3.15's error for ``"full"`` on TensorFlow (a
    layer's wrapped ValueError, then the arguments it received)."""
    traceback = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                 "ValueError: Exception encountered when calling Functional.call().\n\n"
                 "\x1b[1mThe custom_gradient decorator currently supports keywords arguments only when eager "
                 "execution is enabled.\x1b[0m\n\nArguments received by Functional.call():\n"
                 "  • inputs=tf.Tensor(shape=(32, 64), dtype=float32)\n  • training=True\n")
    assert _error_summary(traceback) == (
        "ValueError: Exception encountered when calling Functional.call(). The custom_gradient decorator "
        "currently supports keywords arguments only when eager execution is enabled.")
    assert _error_summary("RuntimeError: plain\n") == "RuntimeError: plain"


def test_remat_changes_the_answer_and_the_plan_is_the_fastest_candidate(tmp_path):
    """Without remat the 160 MiB budget holds B = 288 or so; with the GELU
    outputs recomputed about twice that. ``"full"`` cannot be applied on
    TensorFlow by Keras 3.15 (``tf.recompute_grad`` over a call with keyword
    arguments, in a graph) and is listed last with that error. The plan is
    whichever fitting candidate trains more samples per second, however the
    CPU's timings fall."""
    plan = plan_accumulation(BUILD, BATCH, target_batch_size=TARGET, memory_limit="160MiB", margin=1.0,
                             multiple_of=32, start=256, remat=True, verbose=False)
    by_mode = {c["remat"]: c for c in plan.candidates}
    assert set(by_mode) == {None, "activations", "full"}
    assert plan.candidates[-1]["remat"] == "full" and "custom_gradient" in by_mode["full"]["error"]
    plain, remat = by_mode[None], by_mode["activations"]
    assert remat["micro_batch_size"] > plain["micro_batch_size"]
    for c in (plain, remat):
        assert c["gradient_accumulation_steps"] == -(-TARGET // c["micro_batch_size"])
        assert c["samples_per_second"] == pytest.approx(
            TARGET / (c["gradient_accumulation_steps"] * c["seconds_per_micro_step"]))
        (trial,) = [t for t in plan.trials if t["remat"] == c["remat"] and t["micro_batch_size"] == c["micro_batch_size"]]
        assert trial["fits"] and trial["peak_bytes"] == c["peak_bytes"]
        assert trial["seconds_per_micro_step"] == c["seconds_per_micro_step"]
    best = max((plain, remat), key=lambda c: c["samples_per_second"])
    assert plan.candidates[0] == best and plan.remat == best["remat"]
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (
        best["micro_batch_size"], best["gradient_accumulation_steps"])
    rows = plan.table().splitlines()
    assert any(row.split()[:3] == ["full", "not", "planned,"] for row in rows)
    assert Plan.from_json(plan.to_json(tmp_path / "plan.json")) == plan
    # Independently: at the remat candidate's B the scope saves memory
    # (measured: 190 against 159 MiB at B = 608), well beyond the
    # allocator's few percent between processes at this size.
    size = remat["micro_batch_size"]
    with_scope = probe(BUILD, BATCH, size, remat="activations")["peak_bytes"]
    without = probe(BUILD, BATCH, size)["peak_bytes"]
    assert without > 1.1 * with_scope
