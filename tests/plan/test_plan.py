"""The accumulation planner (``accum_optimizer.plan``), on the CPU with a
small real model (``tests/support/plan_models.py``; its memory is mostly
activations).

References: independent probes of the same model at the sizes the plan
decides between (the CPU allocator's peak, in fresh processes); the formula
``N = ceil(T / (B * replicas))``; for the search itself, a step function
whose answer is known. The planner's own probes and the independent ones
agree within the allocator's noise (NOISE: the CPU allocator's peak for one
size varied by up to 28 % between processes on this machine, 8.15 against
10.47 MiB at B = 32, from threaded kernels' temporaries; so the sizes the
limit is placed between are four times apart, and the plan's B is checked
against its own trials and an independent probe rather than fixed).
"""

from support.families import require

require("keras3")

import re  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from accum_optimizer.plan import Plan, parse_bytes, plan_accumulation, probe, search_micro_batch_size  # noqa: E402

BUILD, BATCH = "support.plan_models:build", "support.plan_models:batch"
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = 0.3  # relative: what one size's peak varied between processes here (28 %, see above)


@pytest.fixture(scope="module")
def peaks():
    """Independent measurements at B = 16 and 64 (the probes import
    ``support.plan_models`` as a user's module: ``tests/`` is on this
    process' path, which the probes inherit)."""
    return {b: probe(BUILD, BATCH, b)["peak_bytes"] for b in (16, 64)}


def _cli_env():
    """The command line's environment: ``tests/`` on its path, as a user's
    package would be."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)}


# ------------------------------------------------------------------ the search
@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 300), maximum=st.integers(1, 256), start=st.integers(1, 300),
       multiple_of=st.integers(1, 16))
def test_search_finds_the_largest_fitting_multiple_and_probes_its_neighbour(threshold, maximum, start, multiple_of):
    """``fits(B) = B <= threshold`` (memory grows with B): the answer is the
    largest multiple of ``multiple_of`` up to ``min(threshold, maximum)``; it
    and the next multiple were both tried (unless it is the maximum), and no
    size twice."""
    tried = []

    def fits(b):
        tried.append(b)
        return b <= threshold

    got = search_micro_batch_size(fits, maximum, start, multiple_of)
    top = min(threshold, maximum) // multiple_of * multiple_of
    assert got == (top or None)
    assert len(tried) == len(set(tried)) and all(b % multiple_of == 0 and 0 < b <= maximum for b in tried)
    if got is not None:
        assert got in tried
        if got + multiple_of <= maximum:
            assert got + multiple_of in tried
    elif maximum >= multiple_of:
        assert multiple_of in tried  # the smallest size was tried before giving up


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 300), maximum=st.integers(1, 256), start=st.integers(1, 300),
       multiple_of=st.integers(1, 16), data=st.data())
def test_search_with_any_guesses_finds_the_same_answer_in_bounded_probes(threshold, maximum, start, multiple_of,
                                                                          data):
    """Whatever ``estimate`` guesses (any size, or no guess), the answer is
    the plain search's, each size is tried once, the answer's neighbour was
    tried, and the probes are at most three times the plain search's plus
    two (two guided probes per doubling or bisection step)."""
    plain = []
    expected = search_micro_batch_size(lambda b: plain.append(b) or b <= threshold, maximum, start, multiple_of)
    guesses = st.none() | st.integers(-50, 600)
    tried = []
    got = search_micro_batch_size(lambda b: tried.append(b) or b <= threshold, maximum, start, multiple_of,
                                  estimate=lambda last_fit, first_fail: data.draw(guesses))
    assert got == expected
    assert len(tried) == len(set(tried)) and all(b % multiple_of == 0 and 0 < b <= maximum for b in tried)
    if got is not None and got + multiple_of <= maximum:
        assert got + multiple_of in tried
    assert len(tried) <= 3 * len(plain) + 2


def test_a_line_through_the_peaks_finds_the_answer_in_fewer_probes():
    """Peaks flat at small B then linear (the example CNN's shape:
    ``200 + max(0, B - 32)`` MiB-like units) against a budget of 460: the
    answer (292) is the plain search's, found in fewer probes with
    :func:`linear_estimate` (hand count: the plain search doubles 1..256,
    fails 512, bisects 384, 320, 288, 304, 296, 292, 294, 293: 18 probes;
    with the line: 1..64 as before (the peaks of 1..32 are equal, and 232 at
    64 is the first 15 % above the size before), the line through (32, 200)
    and (64, 232) hits 460 at 292, then 293 closes it: 9)."""
    from accum_optimizer.plan import linear_estimate

    def peak(b):
        return 200 + max(0, b - 32)

    plain, trials = [], []

    def fits(b):
        trials.append({"micro_batch_size": b, "peak_bytes": peak(b)})
        return peak(b) <= 460

    assert search_micro_batch_size(lambda b: plain.append(b) or peak(b) <= 460, 1024) == 292
    assert search_micro_batch_size(fits, 1024, estimate=linear_estimate(trials, 460)) == 292
    assert (len(plain), len(trials)) == (18, 9)
    assert [t["micro_batch_size"] for t in trials][-2:] == [292, 293]


# ------------------------------------------------------------------ the plan
def test_plan_chooses_the_largest_size_under_the_limit_and_its_n(peaks):
    """A ``memory_limit`` halfway between the peaks measured at 16 and 64
    (four times apart: told apart beyond the noise): the plan's B fits by its
    own trial, and an independent probe at B agrees with that trial within
    the noise; B + 16 was tried and does not fit; B is a multiple of 16 in
    [16, 64); N and the effective batch follow the formula; the peaks of the
    doubling sizes grow with B."""
    assert peaks[64] > peaks[16] * (1 + NOISE) ** 2  # the limit is beyond the noise of both
    limit = (peaks[16] + peaks[64]) // 2
    lines = []
    plan = plan_accumulation(BUILD, BATCH, target_batch_size=100, memory_limit=limit, margin=1.0,
                             max_micro_batch_size=64, multiple_of=16, log=lines.append)
    b = plan.micro_batch_size
    assert b in (16, 32, 48) and plan.device == "CPU:0" and plan.replicas == 1
    assert plan.gradient_accumulation_steps == -(-100 // b) and plan.effective_batch_size == plan.gradient_accumulation_steps * b
    by_size = {t["micro_batch_size"]: t for t in plan.trials}
    assert by_size[b]["fits"] and not by_size[b + 16]["fits"]
    assert plan.peak_bytes == by_size[b]["peak_bytes"] <= limit
    independent = peaks[16] if b == 16 else probe(BUILD, BATCH, b)["peak_bytes"]
    assert abs(by_size[b]["peak_bytes"] - independent) <= NOISE * independent
    doubling = [by_size[size]["peak_bytes"] for size in (16, 32, 64) if size in by_size]
    assert doubling == sorted(doubling) and len(doubling) >= 2
    assert all(t["seconds_per_micro_step"] > 0 for t in plan.trials if t["peak_bytes"] is not None)
    assert any(f"B={b}:" in line and "fits" in line for line in lines) and f"micro_batch_size={b}," in "".join(lines)


def _recording(planner, fork):
    """A ``_Prober`` on the given route that records the processes it starts
    and the process each probe measured in."""
    started, measured_in = [], []

    class Recording(planner._Prober):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "fork": fork})

        def _start(self, *args):
            process, stderr = super()._start(*args)
            started.append(process)
            return process, stderr

        def measure(self, *args, **kwargs):
            result = super().measure(*args, **kwargs)
            measured_in.append(result.get("pid"))
            return result

    return Recording, started, measured_in


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "spawn"])
@pytest.mark.parametrize("batch", ["batch_oom_above", "batch_killed_above"])
def test_each_probe_runs_in_a_fresh_process(monkeypatch, fork, batch):
    """Each probe measures in a process of its own (none reused: TensorFlow
    keeps a cleared model's buffers), and none is left when the search
    ends. From B = 24 (``OOM_FROM``) the batch function raises TensorFlow's
    out-of-memory error, or the process is killed (``SIGKILL``, as by the
    kernel's out-of-memory killer): both mean "does not fit". Sizes 16
    (fits), 32 and 24 (no), 20 (fits): B = 20. Forked: one server process,
    a child per probe. Spawned: four processes measured, and ``AHEAD`` more
    started ahead of probes that never came."""
    import accum_optimizer.plan as planner
    from support.plan_models import OOM_FROM

    Recording, started, measured_in = _recording(planner, fork)
    monkeypatch.setattr(planner, "_Prober", Recording)
    plan = plan_accumulation(BUILD, f"support.plan_models:{batch}", target_batch_size=64, memory_limit="1GiB",
                             margin=1.0, max_micro_batch_size=32, multiple_of=4, start=16, verbose=False)
    assert [(t["micro_batch_size"], t["peak_bytes"] is None) for t in plan.trials] == [
        (16, False), (32, True), (24, True), (20, False)]
    assert plan.micro_batch_size == 20 == OOM_FROM - 4
    fitted = [pid for pid, t in zip(measured_in, plan.trials) if t["peak_bytes"] is not None]
    if fork:
        (server,) = started
        assert len(set(fitted)) == 2 and server.pid not in fitted
    else:
        assert len(started) == 4 + planner._Prober.AHEAD and fitted == [started[0].pid, started[3].pid]
    assert all(p.poll() is not None for p in started)


def test_a_module_that_starts_tensorflow_at_import_is_probed_without_forking(monkeypatch):
    """``support.plan_tf_at_import`` runs a TensorFlow op when imported: its
    runtime's threads start, so the fork server declines (forking them is
    unsafe) and each probe gets a process of its own; the plan is the same
    as the forked one's would be (16 fits, 32 does not: B = 16)."""
    import accum_optimizer.plan as planner

    Recording, started, measured_in = _recording(planner, None)
    monkeypatch.setattr(planner, "_Prober", Recording)
    plan = plan_accumulation("support.plan_tf_at_import:build", "support.plan_models:batch_oom_above",
                             target_batch_size=64, memory_limit="1GiB", margin=1.0, max_micro_batch_size=32,
                             multiple_of=16, start=16, verbose=False)
    assert [(t["micro_batch_size"], t["fits"]) for t in plan.trials] == [(16, True), (32, False)]
    server, *spawned = started
    assert spawned and measured_in[0] == spawned[0].pid != server.pid


def test_json_round_trip_and_plot(tmp_path):
    plan = Plan(micro_batch_size=16, gradient_accumulation_steps=7, effective_batch_size=112, peak_bytes=6 * 2**20,
                target_batch_size=100, memory_limit=8 * 2**20, margin=0.9, replicas=1, multiple_of=16,
                max_micro_batch_size=64, device="CPU:0", seconds=12.5, trials=[
                    {"micro_batch_size": 16, "peak_bytes": 6 * 2**20, "fits": True, "seconds_per_micro_step": 0.01},
                    {"micro_batch_size": 32, "peak_bytes": None, "fits": False, "seconds_per_micro_step": None}])
    assert Plan.from_json(plan.to_json(tmp_path / "plan.json")) == plan
    png = plan.plot(tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "OOM" in plan.table() and "effective_batch_size=112 (target 100, 12 more)" in plan.table()
    wide = Plan(**{**plan.__dict__, "micro_batch_size": 232, "gradient_accumulation_steps": 5,
                   "effective_batch_size": 1160, "target_batch_size": 1024, "multiple_of": 8})
    # N = 5 reaches 1024 with ceil(1024 / 5) = 205 -> 208 (a multiple of 8): 1040
    assert (wide.balanced_micro_batch_size, wide.balanced_effective_batch_size) == (208, 1040)
    assert "micro_batch_size=208 (effective batch 1040)" in wide.table()


def test_command_line_refuses_a_plot_without_matplotlib_before_any_probe(tmp_path, monkeypatch, capsys):
    """``--plot`` where matplotlib cannot be imported: exit status 2 and the
    install line, before :func:`plan_accumulation` runs (not after minutes
    of probes)."""
    import importlib.util

    from accum_optimizer.plan import __main__ as cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    monkeypatch.setattr(cli, "plan_accumulation", lambda *a, **k: pytest.fail("planned without matplotlib"))
    argv = [BUILD, BATCH, "--target-batch-size", "40", "--memory-limit", "1GiB", "--plot", str(tmp_path / "p.png")]
    assert cli.main(argv) == 2
    assert "--plot needs matplotlib: pip install \"accum_optimizer[plan]\"" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_command_line_gives_the_plan_of_the_function(tmp_path, monkeypatch, peaks):
    """The command line calls :func:`plan_accumulation` with its arguments
    (recorded in-process: every option maps to the same keyword), prints the
    table and writes the plan's JSON and plot: the function's plan (B = 16
    is the only size the request allows: one probe, its peak within the
    noise of the independent one). ``python -m accum_optimizer.plan`` as a
    process of its own: the does-not-fit test below."""
    from accum_optimizer.plan import __main__ as cli

    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return plan_accumulation(*args, **kwargs)

    monkeypatch.setattr(cli, "plan_accumulation", recording)
    argv = [BUILD, BATCH, "--target-batch-size", "40", "--memory-limit", "1GiB", "--margin", "0.8",
            "--max-micro-batch-size", "16", "--multiple-of", "16", "--replicas", "1", "--start", "16",
            "--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]
    assert cli.main(argv) == 0
    assert calls == [((BUILD, BATCH), dict(target_batch_size=40, memory_limit="1GiB", margin=0.8,
                                          max_micro_batch_size=16, multiple_of=16, replicas=1, start=16,
                                          repeats=1, remat=None))]
    got = Plan.from_json(tmp_path / "plan.json")
    assert (got.micro_batch_size, got.gradient_accumulation_steps, got.effective_batch_size) == (16, 3, 48)
    assert [t["micro_batch_size"] for t in got.trials] == [16]
    assert abs(got.peak_bytes - peaks[16]) <= NOISE * peaks[16]
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ errors
def test_repeats_measure_a_sizes_spread_over_fresh_processes_and_fit_with_it():
    """``repeats=3`` at the one size asked for (B = 16): three probes, each in
    a fresh process; the trial's peak is the largest, its spread the largest
    minus the smallest; it fits because peak plus spread is within a 1 GiB
    limit; the plan and its table give the spread and the headroom."""
    plan = plan_accumulation(BUILD, BATCH, target_batch_size=32, memory_limit="1GiB", max_micro_batch_size=16,
                             multiple_of=16, start=16, repeats=3, verbose=False)
    (trial,) = plan.trials
    peaks = trial["peaks"]
    assert len(peaks) == 3 and all(p > 0 for p in peaks) and trial["fits"]
    assert trial["peak_bytes"] == max(peaks) == plan.peak_bytes
    assert trial["spread_bytes"] == max(peaks) - min(peaks) == plan.spread_bytes
    assert plan.repeats == 3 and plan.headroom_bytes == plan.budget_bytes - max(peaks)
    assert (f"headroom at B=16: {plan.headroom_bytes / 2**20:.1f} MiB" in plan.table()
            and f"varied by {plan.spread_bytes / 2**20:.1f} MiB over 3 probes" in plan.table())


@pytest.mark.parametrize("kwargs, match", [
    (dict(repeats=0), r"`repeats` must be a positive integer.*repeats=0"),
    (dict(remat="larger_than"), r"`remat` must be True, False, None, or one or more of.*remat='larger_than'"),
    (dict(target_batch_size=0), r"`target_batch_size` must be a positive integer.*target_batch_size=0"),
    (dict(memory_limit="-1GiB"), r"`memory_limit` must be a positive.*'-1GiB'"),
    (dict(memory_limit="10 parsecs"), r"`memory_limit`.*'10 parsecs'"),
    (dict(margin=1.5), r"`margin` must be a number in \(0, 1\].*margin=1.5"),
    (dict(multiple_of=0), r"`multiple_of` must be a positive integer.*multiple_of=0"),
    (dict(max_micro_batch_size=-4), r"`max_micro_batch_size`.*-4"),
    (dict(build="no_such_module_42:build"), r"`build`='no_such_module_42:build'.*cannot be imported"),
    (dict(batch="support.plan_models:nope"), r"`batch`='support.plan_models:nope'.*no callable 'nope'"),
    (dict(build="support.plan_models"), r"`build` must be an importable 'module:function'"),
    (dict(target_batch_size=4, multiple_of=8), r"No micro-batch size is a multiple of multiple_of=8"),
])
def test_bad_arguments_are_named_before_any_probe(kwargs, match):
    args = dict(build=BUILD, batch=BATCH, target_batch_size=64, memory_limit="1GiB")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_accumulation(**args, verbose=False)


def test_memory_limit_is_required_on_the_cpu():
    with pytest.raises(ValueError, match=r"`memory_limit` is required where there is no GPU"):
        plan_accumulation(BUILD, BATCH, target_batch_size=64, verbose=False)


def test_parse_bytes_units():
    assert parse_bytes("10GiB") == 10 * 2**30 and parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(2e9) == 2_000_000_000 and parse_bytes(1024) == 1024


def test_a_failing_build_function_shows_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)raised, in the probe process.*no such dataset 'imagenet-42'"):
        plan_accumulation("support.plan_models:build_raises", BATCH, target_batch_size=8, memory_limit="1GiB",
                          verbose=False)


def test_a_model_that_does_not_fit_at_the_smallest_size_says_what_it_needed(tmp_path):
    """Through the command line (which calls the function): exit status 2,
    the message with the bytes needed and the budget (0.9 x 64 KiB), and
    nothing written."""
    out = subprocess.run(
        [sys.executable, "-m", "accum_optimizer.plan", BUILD, BATCH, "--target-batch-size", "8",
         "--memory-limit", "64KiB", "--json", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=600, env=_cli_env(),
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert re.search(r"does not fit even at micro_batch_size=1: it needed \d+ bytes against a budget of "
                     r"58982 bytes \(margin=0.9 x memory_limit=65536\)", out.stderr), out.stderr[-3000:]
    assert not (tmp_path / "plan.json").exists()


def test_the_worked_example_in_the_readme_and_docs_is_the_saved_plan():
    """README and docs/plan.md show the table of ``docs/plan/plan.json``,
    which the command they name wrote (with ``docs/plan/plan.png``)."""
    root = pathlib.Path(TESTS).parent
    plan = Plan.from_json(root / "docs" / "plan" / "plan.json")
    assert (root / "docs" / "plan" / "plan.png").exists()
    assert plan.micro_batch_size % plan.multiple_of == 0 and plan.effective_batch_size >= plan.target_batch_size
    for page in ("README.md", "docs/plan.md"):
        text = (root / page).read_text()
        block = text.split("<!-- plan-example:begin -->")[1].split("<!-- plan-example:end -->")[0]
        assert block.strip() == f"```text\n{plan.table()}\n```", page
        assert "examples.plan_model:build examples.plan_model:batch" in text


def test_the_remat_example_in_the_docs_is_the_saved_plan():
    """docs/plan.md's TensorFlow remat example is the table of
    ``docs/plan/plan_remat_tf.json``, which the command it names wrote: no
    remat, ``"activations"`` (a larger B) and ``"full"`` (not applicable in
    a TensorFlow graph), the fastest chosen."""
    root = pathlib.Path(TESTS).parent
    plan = Plan.from_json(root / "docs" / "plan" / "plan_remat_tf.json")
    fitting = [c for c in plan.candidates if "error" not in c]
    assert plan.backend == "tensorflow" and plan.candidates[0] == max(fitting, key=lambda c: c["samples_per_second"])
    text = (root / "docs" / "plan.md").read_text()
    block = text.split("<!-- plan-remat-tf-example:begin -->")[1].split("<!-- plan-remat-tf-example:end -->")[0]
    assert block.strip() == f"```text\n{plan.table()}\n```"
    assert "support.plan_remat:build support.plan_remat:batch" in text
