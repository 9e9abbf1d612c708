"""The accuracy table's page and figures (`scripts/eval.py`): its Markdown, the paired comparisons to a
chosen row, the accuracy-versus-bits figure with its Pareto front, and the K/V error map."""

from __future__ import annotations

import re

import numpy as np

from rq_jax import report, scoring
from rq_jax.eval.table import pareto_front


def write(prefix: str, meta: dict, rows: list[dict], kv_err: dict, loops: int, compare: tuple[str, ...] = ()) -> str:
    """The run's outputs under `prefix`: PREFIX.md (the page, returned), PREFIX.json (`meta`, the rows and
    the K/V error), PREFIX_accuracy.png and PREFIX_kv_error.png."""
    text = markdown(rows, header(meta), compare)
    report.write_text(f"{prefix}.md", text)
    report.write_run(prefix, meta, rows, kv_error=kv_err)
    figures(rows, kv_err, loops, prefix)
    return text


def header(meta: dict) -> str:
    """The page's title (the run's settings, `meta`) and what its accuracy column means."""
    return (f"# {meta['family']} ({meta['checkpoint']}), {meta['loops']} loops; {meta['n']} held-out examples per "
            f"task, {meta['retrieval_pairs']}-pair retrieval, {meta['text_windows']} stdlib windows (Python "
            f"{meta['python']})\n\n"
            "Accuracy: exact match through the cache, with the 95% paired-bootstrap CI of its difference to the "
            "float32 dense cache.")


def fmt_ci(m: dict) -> str:
    """"98.0 (-1.2, +0.4)": a task's accuracy (%) and the 95% CI of its difference to the dense cache."""
    return f"{100 * m['accuracy']:.1f} ({100 * m['accuracy_diff_lo']:+.1f}, {100 * m['accuracy_diff_hi']:+.1f})"


def comparison(rows: list[dict], label: str) -> list[str]:
    """Markdown lines: each row's accuracy difference to row `label`'s, paired on the same answers."""
    base = next(r for r in rows if r["scheme"] == label)
    lines = ["", f"Against `{label}`: accuracy difference in points, paired on the same answers (95% CI).", "",
             "| scheme | bits/elem | addition Δ (CI) | retrieval Δ (CI) |", "|---|---|---|---|"]
    for r in rows:
        if r is base:
            continue
        cells = []
        for task in ("addition", "retrieval"):
            if "correct" in r[task] and "correct" in base[task]:  # rows of older runs lack the outcomes
                diff, lo, hi = scoring.paired_rows(r[task]["correct"], base[task]["correct"])
                cells.append(f"{100 * diff:+.1f} ({100 * lo:+.1f}, {100 * hi:+.1f})")
            else:
                cells.append("—")
        lines.append(f"| {r['scheme']} | {r['bits_per_element']:.3f} | {cells[0]} | {cells[1]} |")
    return lines


def markdown(rows: list[dict], header: str, compare: tuple[str, ...] = ()) -> str:
    """The run's page: `header`, the table of every row, the fitted rotations' holdout losses, the values
    a format could not store, the dense reference, and a `comparison` per label of `compare`."""
    lines = [header, "",
             "| scheme | bits/elem | bytes/token | addition % (Δ CI) | retrieval % (Δ CI) | agree add/ret/text | "
             "KL add/ret/text | answer NLL add/ret | bpb |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, q, t = r["addition"], r["retrieval"], r["text"]
        lines.append(f"| {r['scheme']} | {r['bits_per_element']:.3f} | {r['bytes_per_token']:,.0f} | {fmt_ci(a)} | "
                     f"{fmt_ci(q)} | {a['agreement']:.3f} / {q['agreement']:.3f} / {t['agreement']:.3f} | "
                     f"{a['kl']:.2e} / {q['kl']:.2e} / {t['kl']:.2e} | {a['answer_nll']:.3f} / {q['answer_nll']:.3f} | "
                     f"{t['bpb']:.3f} |")
    fitted = [r for r in rows if "key_before" in r.get("calibration", {})]
    if fitted:
        lines += ["", "Calibrated rotations: mean per-head holdout loss (App. G.1), default Hadamard → fitted.", "",
                  "| scheme | L_K before | L_K after | L_V before | L_V after |", "|---|---|---|---|---|"]
        lines += [f"| {r['scheme']} | " + " | ".join(f"{r['calibration'][k]:.3e}" for k in
                                                     ("key_before", "key_after", "value_before", "value_after")) + " |"
                  for r in fitted]
    lost = {r["scheme"]: sum(r[t]["out_of_range"] for t in ("addition", "retrieval", "text")) for r in rows}
    lines += ["", "Values a format could not store (metadata outside FP8's range, non-finite K/V): " +
              (", ".join(f"{k} {v:,}" for k, v in lost.items() if v) or "none") + "."]
    dense = rows[0] if rows else None
    if dense:
        lines += ["", f"Dense float32 reference: addition {100 * dense['addition']['dense_accuracy']:.1f}%, retrieval "
                      f"{100 * dense['retrieval']['dense_accuracy']:.1f}%, "
                      f"{dense['text']['dense_bpb']:.3f} bits per byte."]
    for label in compare:
        lines += comparison(rows, label)
    return "\n".join(lines) + "\n"


#: Marker of each scheme family in the accuracy figure (by label prefix; the ladder's rows are the rest:
#: circles at the first group size, pentagons at the others).
MARKERS = {"dense": "s", "uniform": "v", "direct": "v", "rotated": "^", "kivi": "D", "residual_vq": "X",
           "allocated": "*", "share": "P", "compress": "h",
           "vLLM": "d"}


def bit_ticks(bits: list[float]) -> list[float]:
    """Ticks of the log bits axis: whole numbers within the range, halves when fewer than three fit,
    else the values themselves."""
    lo, hi = min(bits) / 1.15, max(bits) * 1.15
    for candidates in ((1, 2, 3, 4, 5, 6, 8, 12, 16), (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16)):
        ticks = [b for b in candidates if lo <= b <= hi]
        if len(ticks) >= 3:
            return ticks
    return bits


def figures(rows: list[dict], kv_err: dict, loops: int, prefix: str) -> None:
    """PREFIX_accuracy.png (exact match against bits per element, a hollow marker and a colour per
    scheme, the legend naming them, and the Pareto front: the best accuracy at each number of bits or
    fewer) and PREFIX_kv_error.png (K and V NMSE per loop and layer)."""
    # heavy: matplotlib (~0.3 s), only figures need it
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator

    plt = report.pyplot()
    tab = plt.get_cmap("tab20").colors
    colors = tab[0::2] + tab[1::2]  # the ten strong hues first, then their light twins
    sizes = [m[0] for r in rows if (m := re.findall(r"\bg\d+\b", r["scheme"]))]
    first_g = sizes[0] if sizes else None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    bits = sorted({r["bits_per_element"] for r in rows})
    for ax, task in zip(axes, ("addition", "retrieval")):
        for i, r in enumerate(rows):
            label = r["scheme"]
            marker = next((m for k, m in MARKERS.items() if label.startswith(k)),
                          "o" if first_g is None or first_g in label.split() else "p")
            ax.scatter(r["bits_per_element"], 100 * r[task]["accuracy"], s=60, marker=marker, linewidths=1.5,
                       facecolors="none", edgecolors=colors[i % len(colors)], label=label, clip_on=False, zorder=3)
        front = pareto_front([(r["bits_per_element"], 100 * r[task]["accuracy"]) for r in rows])
        ax.step(*zip(*front), where="post", color="0.6", linestyle="--", linewidth=1, label="Pareto front", zorder=1)
        low = min(100 * r[task]["accuracy"] for r in rows)
        ax.set(xscale="log", xlabel="bits per element (log scale)", ylabel="exact match (%)",
               ylim=(max(0, 10 * (low // 10) - 10), 100))
        ax.set_title(task, pad=12)  # clear of the markers at 100%
        ax.xaxis.set_major_locator(FixedLocator(bit_ticks(bits)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%.3g"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(bits) / 1.15, max(bits) * 1.15)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.8, 0.5), fontsize=7, frameon=False,
               title="scheme", title_fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    report.save_figure(fig, f"{prefix}_accuracy.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, name in zip(axes, ("k", "v")):
        err = np.asarray(kv_err[f"{name}_layer"]).T  # [layers, loops]
        im = ax.imshow(err, aspect="auto", cmap="viridis", origin="lower")
        ax.set(xlabel="loop", ylabel="layer", title=f"{name.upper()} NMSE, {kv_err['scheme']}")
        ax.set_xticks(range(loops))
        ax.set_yticks(range(err.shape[0]))
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    report.save_figure(fig, f"{prefix}_kv_error.png")
