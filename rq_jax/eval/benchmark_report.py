"""Table 2's pages (`scripts/eval_benchmarks.py`): one run's table, its figure and its files, and the
grid that lays several runs out as the paper's Table 2."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from rq_jax import report
from rq_jax.cache.schemes import TABLE2_METHODS, TABLE2_SETTINGS
from rq_jax.eval.benchmark_run import BENCHMARKS, all_rows


def header(meta: dict) -> str:
    """The page's title (the run's settings, `meta`) and what each column means."""
    heading = BENCHMARKS[meta["benchmark"]].heading
    sampling = "greedy" if meta["temperature"] == 0 else f"temperature {meta['temperature']}"
    return (f"# {heading} on {os.path.basename(meta['checkpoint'])} ({meta['family']}, {meta['loops']} loops, "
            f"{meta['dtype']} compute, {meta['param_dtype']} weights): {meta['problems']} problems, "
            f"{meta['protocol']}, {sampling}, ≤ {meta['max_new_tokens']} new tokens\n\n"
            "Accuracy (pass@1 for code) through each cache, with the 95% paired-bootstrap CI of its difference to "
            "dense bf16; agree: the same extracted answer as dense bf16 (code: the same cleaned program); tokens: "
            "mean generated tokens per answer; tok/s: generated tokens per second of generation (compiles "
            "excluded); b_eff: bits per stored K/V element; bytes per token of one slot, and its ratio to dense "
            "bf16; out of range: values the cache could not store.")


def write(prefix: str, meta: dict, rows: Sequence[dict]) -> str:
    """The run's outputs: PREFIX.md (the page, returned), PREFIX.json (`meta` and the rows) and
    PREFIX_accuracy.png."""
    heading = BENCHMARKS[meta["benchmark"]].heading
    text = markdown(rows, header(meta), heading) + "\n" + settings_note(rows)
    report.write_text(f"{prefix}.md", text)
    report.write_run(prefix, meta, rows)
    figure(rows, f"{prefix}_accuracy.png", f"{heading}, {os.path.basename(meta['checkpoint'])}")
    return text


def combine(runs: Sequence[dict]) -> str:
    """The page of several runs' JSON (`report.read_run`): a title naming each run, then `grid`."""
    return "\n".join(["# Table 2 layout: accuracy (%) per scheme, " + ", ".join(
        f"{r['meta']['family']} {r['meta']['benchmark']} ({os.path.basename(r['meta']['checkpoint'])}, "
        f"n={r['meta']['problems']}, {r['meta']['prompt_format']})" for r in runs), "", grid(runs)])


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _setting_heading(setting: str, rows: Sequence[dict]) -> str:
    """"INT2 g32 (2.5)": the setting with its Direct row's bits per element, as Table 2 writes it."""
    direct = next((r for r in rows if r["setting"] == setting and r["method"] == "Direct" and "accuracy" in r), None)
    return f"{setting} ({direct['bits_per_element']:.1f})" if direct else setting


def markdown(rows: Sequence[dict], header: str, heading: str) -> str:
    """The run's table: Table 2's Setting and Method columns, then this benchmark's accuracy and the rest."""
    lines = [header, "",
             f"| Setting | Method | scheme | {heading} % | Δ vs BF16 (95% CI) | agree | tokens | tok/s | b_eff | "
             "bytes/token (× dense) | out of range |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    last = None
    for r in rows:
        setting = "BF16" if r["scheme"] == "dense bf16" else (r["setting"] or "other")
        cell = "" if setting == last else (_setting_heading(r["setting"], rows) if r["setting"] else setting)
        last = setting
        method = r["method"] or "—"
        if "accuracy" not in r:
            lines.append(f"| {cell} | {method} | {r['scheme']} | {r['missing']} | | | | | | | |")
            continue
        lo, hi = 100 * r["accuracy_diff_lo"], 100 * r["accuracy_diff_hi"]
        ci = "—" if r["scheme"] == "dense bf16" else f"{100 * r['accuracy_diff']:+.1f} ({lo:+.1f}, {hi:+.1f})"
        speed = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "—"
        lines.append(f"| {cell} | {method} | {r['scheme']} | {_pct(r['accuracy'])} | {ci} | {r['agreement']:.3f} | "
                     f"{r['mean_tokens']:.1f} | {speed} | {r['bits_per_element']:.3f} | "
                     f"{r['bytes_per_token']:,.0f} ({r['bytes_per_token'] / r['dense_bytes_per_token']:.2f}) | "
                     f"{r['out_of_range']:,} |")
    return "\n".join(lines) + "\n"


def grid(runs: Sequence[dict]) -> str:
    """Table 2's layout from several runs' JSON (one per model and benchmark): rows Setting / Method,
    one accuracy column per run ("Ouro G8K", ...), and Avg over the columns where a row has them all."""
    columns = [(f"{run['meta']['family'].capitalize()} {BENCHMARKS[run['meta']['benchmark']].short}",
                {r["scheme"]: r for r in run["rows"]}) for run in runs]
    lines = ["| Setting | Method | " + " | ".join(c for c, _ in columns) + " | Avg |",
             "|---|---|" + "---|" * (len(columns) + 1)]
    every = [r for run in runs for r in run["rows"]]
    last = None
    for row in all_rows().values():  # Table 2's rows in its order, then the catalog's others
        cells = [col.get(row.scheme.label) for _, col in columns]
        if not any(c and "accuracy" in c for c in cells):
            continue
        values = [100 * c["accuracy"] if c and "accuracy" in c else None for c in cells]
        setting = "BF16" if row.scheme.label == "dense bf16" else (row.setting or "other")
        heading = _setting_heading(row.setting, every) if row.setting else setting
        avg = f"{np.mean(values):.2f}" if all(v is not None for v in values) else "—"
        method = row.method or row.scheme.label
        lines.append(f"| {'' if setting == last else heading} | {method} | "
                     + " | ".join("—" if v is None else f"{v:.2f}" for v in values) + f" | {avg} |")
        last = setting
    return "\n".join(lines) + "\n"


def figure(rows: Sequence[dict], path: str, title: str) -> None:
    """Accuracy against bits per element, one line per Table 2 method across the settings (by bits; two
    settings at the same bits join vertically), dense bf16 as a dashed line; other schemes as labelled points."""
    plt = report.pyplot()
    done = [r for r in rows if "accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = next((r for r in done if r["scheme"] == "dense bf16"), None)
    if dense:
        ax.axhline(100 * dense["accuracy"], color="k", ls="--", lw=1, label="BF16")
    for method in TABLE2_METHODS:
        pts = sorted((r["bits_per_element"], 100 * r["accuracy"], r["setting"]) for r in done if r["method"] == method)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", mfc="none", label=method)  # overlaps show
            for x, y, setting in pts:
                ax.annotate(setting, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for r in done:
        if not r["method"] and r["scheme"] != "dense bf16":
            ax.scatter(r["bits_per_element"], 100 * r["accuracy"], s=14, color="gray")
            ax.annotate(r["scheme"], (r["bits_per_element"], 100 * r["accuracy"]), fontsize=6)
    ax.set(xlabel="bits per element (b_eff)", ylabel="accuracy / pass@1 (%)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_figure(fig, path)


def settings_note(rows: Sequence[dict]) -> str:
    """How the rows' INT2/4 settings are built (for the table's footer; "" when there are none)."""
    used = {r["setting"] for r in rows}
    mixed = [f"{name}: bits {list(b)}, group sizes {list(g)}" for name, (b, g) in TABLE2_SETTINGS.items()
             if 4 in b and name in used]
    return ("INT2/4 settings keep the INT4 anchor (the last loop of a group) at g32: " + "; ".join(mixed) + ".\n"
            if mixed else "")
