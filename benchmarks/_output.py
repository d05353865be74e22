"""What a benchmark prints and writes: progress lines, tables, strict JSON,
figures and the <name>.{json,png,md} trio."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from benchmarks._env import load_average


MIB = 2**20


class Progress:
    """One line per finished item: ``[memory 3/26 +41s] label: result``."""

    def __init__(self, name: str, total: int, stream=None) -> None:
        self.name, self.total, self.done = name, total, 0
        self.start = time.perf_counter()
        self.stream = stream or sys.stdout

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def note(self, text: str) -> None:
        print(f"[{self.name} +{self.elapsed():.0f}s] {text}", file=self.stream, flush=True)

    def step(self, label: str, result: str = "", seconds: float | None = None) -> None:
        self.done += 1
        took = f" ({seconds:.1f}s)" if seconds is not None else ""
        print(f"[{self.name} {self.done}/{self.total} +{self.elapsed():.0f}s] {label}"
              f"{': ' + result if result else ''}{took}", file=self.stream, flush=True)


def write_json(path: Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=json_default, allow_nan=False) + "\n")
    return path


def json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def clean_floats(obj: Any) -> Any:
    """Replace NaN/inf by None so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_floats(v) for v in obj]
    return obj


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_outputs(out: Path, name: str, data: dict, markdown: str, plot_fn, prog) -> None:
    """Write ``<name>.json`` (raw figures), ``<name>.png`` and ``<name>.md``."""
    out = Path(out)
    if isinstance(data.get("env"), dict):  # (the start's is in static_env)
        data["env"]["load_average_at_end"] = load_average()
    jpath = write_json(out / f"{name}.json", clean_floats(data))
    ppath = plot_fn(data, out / f"{name}.png")
    (out / f"{name}.md").write_text(markdown + "\n")
    prog.note(f"wrote {jpath}, {ppath}, {out / f'{name}.md'}")


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], markdown: bool = False) -> str:
    rows = [[str(c) for c in r] for r in rows]
    headers = [str(h) for h in headers]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def fmt_mib(b: float | None, digits: int = 1) -> str:
    return "n/a" if b is None else f"{b / MIB:.{digits}f}"


def fmt_ratio(median: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if median is None:
        return "n/a"
    if lo is None or hi is None:
        return f"{median:.3f}"
    return f"{median:.3f} [{lo:.3f}, {hi:.3f}]"


def print_and_write(out: Path, name: str, data: dict, text: str, markdown: str, plot_fn, prog) -> int:
    """The end of a run: print ``text`` (its table) after a blank line, write
    the outputs (:func:`write_outputs`), and return 0, the exit status."""
    print()
    print(text)
    write_outputs(out, name, data, markdown, plot_fn, prog)
    return 0
