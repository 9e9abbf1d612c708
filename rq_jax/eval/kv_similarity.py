"""How alike a looped model's loops are, behind `scripts/kv_similarity.py`: per layer and loop, each
loop's K/V against its group's last loop (the anchor ResidualQuant codes the others against), and the
paper's Table 1 statistic, as Markdown, a model card's section and a heatmap.

On held-out rows of each task (`task_rows`; a dense float32 prefill, `rq_jax.cache.kv_error.dense_kv`),
`measure` gives per loop and layer:

- cos: the mean cosine of a loop's K (or V) vectors with the anchor loop's;
- rel: ‖x − α·x_anchor‖ / ‖x‖ with α the least-squares scale of each vector (what LS residual coding
  leaves to quantize, relative to the vector);

and per loop NMSE = ‖X̂ − X‖² / ‖X‖² (summed over layers, rows, heads, tokens) of uniform INT2 g32 coding
each loop directly and of residual INT2 g32 against the reconstructed last-loop anchor (α = 1, no
rotation): the paper's Table 1 (Ouro-1.4B keys: direct ≈ 178·10⁻³, residual 53.6 / 28.2 / 19.3·10⁻³ for
loops 1-3), and their ratio residual / direct per loop (paper 0.30 / 0.16 / 0.11). The anchor loop's
row codes the anchor itself (INT2, as in the paper's table). Groups are those of the residual [2,2,2,4]
format (4 loops; Huginn's steps in groups of 4).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from rq_jax import report
from rq_jax.cache.kv_error import dense_kv, loop_similarity, reconstruction_error
from rq_jax.cache.schemes import pick
from rq_jax.data import Addition, Retrieval, collate

#: The schemes of the NMSE columns (labels of `rq_jax.cache.schemes`).
DIRECT, RESIDUAL = "direct INT2 g32", "+residual α=1 g32"
TASKS = ("retrieval", "addition")
#: The model card's section heading (`card_section`, `write_card`).
CARD_SECTION = "## Loop similarity"


def task_rows(task: str, n: int, seed: int) -> np.ndarray:
    """`n` held-out rows [n, T] of one length: additions, or 43-pair retrieval sequences."""
    if task == "addition":
        add = Addition()
        return collate(add.examples("eval", n, seed), add.length)[0]
    ret = Retrieval()
    return collate(ret.examples("eval", n, seed, num_pairs=ret.max_pairs), ret.max_length(ret.max_pairs))[0]


def measure(model, tokens: np.ndarray, loops: int) -> dict:
    """Similarity and NMSE figures of one task's rows `tokens` [B, T] at `loops` loops (see the module
    docstring), JSON-able: k_cos, k_rel, v_cos, v_rel [loop][layer]; {k,v}_nmse_{direct,residual,ratio}
    [loop]."""
    k, v = dense_kv(model, jnp.asarray(tokens), loops)
    direct, residual = (s.fmt for s in pick([DIRECT, RESIDUAL]))
    sim = loop_similarity(k, v, residual.group_len)
    out = {key: value.tolist() for key, value in sim.items()}
    for kind in "kv":
        d, r = reconstruction_error(direct, k, v)[kind], reconstruction_error(residual, k, v)[kind]
        out[f"{kind}_nmse_direct"], out[f"{kind}_nmse_residual"] = d.tolist(), r.tolist()
        out[f"{kind}_nmse_ratio"] = (r / d).tolist()
    return out


def markdown(results: dict, header: str) -> str:
    """The page: `header`, then per task the similarity per (loop, layer) and the NMSE per loop."""
    lines = [header, ""]
    for task, r in results.items():
        loops, layers = np.asarray(r["k_cos"]).shape
        sims = [[loop + 1, layer, *(f"{r[key][loop][layer]:.3f}" for key in ("k_cos", "k_rel", "v_cos", "v_rel"))]
                for loop in range(loops) for layer in range(layers)]
        lines += [f"## {task}", "", *report.table(["loop", "layer", "K cos", "K rel", "V cos", "V rel"], sims)]
        lines += ["", "NMSE ×10³ of INT2 g32 (all layers), direct against residual on the last-loop anchor (α = 1, "
                      "no rotation), and residual / direct:", ""]
        nmse = [[loop + 1, *(f"{r[f'{k}_nmse_ratio'][loop]:.2f}" if w == "ratio" else
                             f"{1e3 * r[f'{k}_nmse_{w}'][loop]:.1f}"
                             for k in "kv" for w in ("direct", "residual", "ratio"))] for loop in range(loops)]
        lines += report.table(["loop", "K direct", "K residual", "K ratio", "V direct", "V residual", "V ratio"], nmse)
        lines.append("")
    return "\n".join(lines)


def card_section(results: dict, rows: int, seed: int) -> str:
    """The model card's section: per task and loop, mean K/V cosine to the anchor and the NMSE ratio."""
    cells = [[task, loop + 1, f"{np.mean(r['k_cos'][loop]):.3f}", f"{np.mean(r['v_cos'][loop]):.3f}",
              f"{r['k_nmse_ratio'][loop]:.2f}", f"{r['v_nmse_ratio'][loop]:.2f}"]
             for task, r in results.items() for loop in range(len(r["k_cos"]) - 1)]
    lines = [CARD_SECTION, "",
             f"`scripts/kv_similarity.py` on {rows} held-out rows per task (seed {seed}): each loop's mean cosine to "
             "its group's last loop (the anchor), and the key / value NMSE of residual INT2 g32 on the anchor over "
             "that of direct INT2 g32 (the paper's Table 1 statistic; Ouro-1.4B keys 0.30 / 0.16 / 0.11).", "",
             *report.table(["task", "loop", "K cos", "V cos", "K residual / direct", "V residual / direct"], cells)]
    return "\n".join(lines) + "\n"


def write_card(folder: str, section: str) -> None:
    """Put `section` into `folder`/README.md in place of an earlier one (or at the end)."""
    path = os.path.join(folder, "README.md")
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    start = text.find(CARD_SECTION)
    if start < 0:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    else:
        end = text.find("\n## ", start + len(CARD_SECTION))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    report.write_text(path, text)


def heatmap(results: dict, path: str) -> None:
    """The figure at `path`: per task (rows) K cos, K rel, V cos, V rel (columns) as [layer, loop] maps."""
    plt = report.pyplot()
    tasks = list(results)
    fig, axes = plt.subplots(len(tasks), 4, figsize=(13, 2.6 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for col, key in enumerate(("k_cos", "k_rel", "v_cos", "v_rel")):
            ax, x = axes[row, col], np.asarray(results[task][key]).T  # [layer, loop]
            low = -1.0 if key.endswith("cos") else 0.0
            im = ax.imshow(x, aspect="auto", cmap="viridis", vmin=low, vmax=1.0, origin="lower")
            ax.set_xticks(range(x.shape[1]), [str(i + 1) for i in range(x.shape[1])])
            ax.set_yticks(range(x.shape[0]))
            what = "cosine to anchor" if key.endswith("cos") else "LS residual ÷ norm"
            ax.set(xlabel="loop", ylabel="layer", title=f"{task}: {key[0].upper()} {what}")
            for (i, j), value in np.ndenumerate(x):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if value < (0.0 if low < 0 else 0.5) else "black")
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    report.save_figure(fig, path, dpi=130)
