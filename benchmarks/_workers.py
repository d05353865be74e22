"""One configuration per fresh worker process: the parent's launcher and the
worker's result line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable

from benchmarks._env import REPO_ROOT
from benchmarks._output import clean_floats, json_default


RESULT_PREFIX = "BENCH_RESULT "


def run_worker(module: str, config: dict, timeout: float) -> dict:
    """Run ``python -m <module> --worker '<json config>'`` in a fresh process.

    The worker prints one ``BENCH_RESULT {json}`` line. Failures come back as
    ``{"status": ...}``: ``"OOM"`` (allocator ran out of memory, or the
    process was killed, usually by the kernel's OOM killer), ``"timeout"`` or
    ``"error"``, with the tail of stderr.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Complete tensor-memory statistics on the CPU (get_memory_info('CPU:0')).
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(config)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result.setdefault("status", "ok")
            result["seconds"] = seconds
            return result
    tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
    oom = proc.returncode in (-9, 137) or any(
        s in proc.stderr for s in ("ResourceExhaustedError", "OOM when allocating", "MemoryError",
                                   "std::bad_alloc"))
    return {"status": "OOM" if oom else "error", "returncode": proc.returncode,
            "stderr_tail": tail, "seconds": seconds}


def run_workers(module: str, configs: list[dict], jobs: int, timeout: float,
                on_done: Callable[[int, dict], None]) -> list[dict]:
    """Run workers, ``jobs`` at a time, in submission order; returns results
    in the order of ``configs`` and calls ``on_done(i, result)`` as each ends."""
    results: list[dict | None] = [None] * len(configs)
    if jobs <= 1:
        for i, c in enumerate(configs):
            results[i] = run_worker(module, c, timeout)
            on_done(i, results[i])
        return results  # type: ignore[return-value]
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_worker, module, c, timeout): i for i, c in enumerate(configs)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            on_done(i, results[i])
    return results  # type: ignore[return-value]


def emit_result(result: dict) -> None:
    """Worker side: print the result line the parent parses."""
    print(RESULT_PREFIX + json.dumps(clean_floats(result), default=json_default), flush=True)
