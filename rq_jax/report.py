"""One report writer for every experiment: a run's Markdown table, its JSON (the settings it ran with and
its rows so far), its figures, and how an interrupted run resumes from that JSON.

The scripts (`eval.py`, `eval_benchmarks.py`, `allocate.py`, `bench_*.py`, `kernel_report.py`) build
their rows in the package and hand them here; what a row holds is theirs, how it reaches disk is this.

    report.write_run("out/run", meta, rows)           # out/run.json: {"meta": ..., "rows": [...]}
    done = report.finished_rows("out/run.json", settings, key="scheme")   # resume: rows by label
    report.write_text("out/run.md", "\n".join(report.table(["scheme", "bits"], [["dense", 16]])))
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence


class SettingsMismatch(ValueError):
    """An earlier run's JSON was written with other settings than this run's (so it cannot be resumed)."""


def row(cells: Iterable[Any]) -> str:
    """One Markdown table line, each cell through `str`: `| a | b |`."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table as lines: the header of `columns`, its rule, then one line per row of cells."""
    return [row(columns), "|" + "---|" * len(columns)] + [row(r) for r in rows]


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (a table, a page) to `path`, its folder made if missing."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_run(prefix: str | os.PathLike, meta: dict, rows: Sequence[dict], **extra) -> str:
    """The run's JSON at `PREFIX.json`: its settings (`meta`), its rows so far and `extra` (what a final
    write adds, e.g. kv_error); written whole after every row, so an interrupted run keeps what it
    finished. Returns the path."""
    path = f"{os.fspath(prefix)}.json"
    write_text(path, json.dumps(dict(meta=meta, rows=list(rows), **extra), indent=2, ensure_ascii=False))
    return path


def read_run(path: str | os.PathLike) -> dict:
    """A run's JSON as `write_run` wrote it ({"meta": ..., "rows": [...], ...}). ValueError naming the
    file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    if not isinstance(run, dict) or not {"meta", "rows"} <= set(run):
        raise ValueError(f"{path} is not a run's JSON (no meta and rows)")
    return run


def finished_rows(path: str | os.PathLike, settings: dict, key: str) -> dict[str, dict]:
    """Rows of an earlier run's JSON at `path` by `row[key]` ({} when there is none), to resume it.
    Raises SettingsMismatch naming the settings that differ (theirs, now) when that run was made with
    other `settings` (other data, another model), and ValueError when the file is not a run."""
    if not os.path.exists(path):
        return {}
    run = read_run(path)
    theirs = {k: run["meta"].get(k) for k in settings}
    if theirs != settings:
        diff = {k: (theirs[k], v) for k, v in settings.items() if theirs[k] != v}
        raise SettingsMismatch(f"{path} was written with other settings (theirs, now): {diff}")
    return {r[key]: r for r in run["rows"]}


def pyplot():
    """matplotlib's pyplot on the Agg backend (figures go to files, no display needed). Imported here on
    first use: matplotlib is heavy and only a run that draws needs it."""
    import matplotlib  # heavy: matplotlib (~0.3 s, pyplot ~0.55 s), only figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: as above, and after use("Agg")

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 150) -> None:
    """Save a matplotlib figure to `path` (its folder made if missing) and close it."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
