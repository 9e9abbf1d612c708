"""How alike a looped model's loops are: per layer and loop, each loop's K/V against its group's last loop
(the anchor ResidualQuant codes the others against), and the paper's Table 1 statistic; Markdown + JSON +
a heatmap.

    python scripts/kv_similarity.py --checkpoint checkpoints/ouro-small --out docs/results/ouro-similarity

On held-out rows of each task (a dense float32 prefill, `rq_jax.cache.kv_error.dense_kv`):

- cos: the mean cosine of a loop's K (or V) vectors with the anchor loop's, per layer;
- rel: ‖x − α·x_anchor‖ / ‖x‖ with α the least-squares scale of each vector (what LS residual coding
  leaves to quantize, relative to the vector), per layer;
- NMSE = ‖X̂ − X‖² / ‖X‖² (summed over layers, rows, heads, tokens) of uniform INT2 g32 coding each loop
  directly and of residual INT2 g32 against the reconstructed last-loop anchor (α = 1, no rotation): the
  paper's Table 1 (Ouro-1.4B keys: direct ≈ 178·10⁻³, residual 53.6 / 28.2 / 19.3·10⁻³ for loops 1-3), and
  their ratio residual / direct per loop (paper 0.30 / 0.16 / 0.11). The anchor loop's row codes the
  anchor itself (INT2, as in the paper's table).

Groups are those of the residual [2,2,2,4] format (4 loops; Huginn's steps in groups of 4). With --card the
NMSE ratios also go into the checkpoint's model card (README.md), as its "Loop similarity" section.
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np

from rq_jax import checkpoint
from rq_jax.cache.kv_error import dense_kv, loop_similarity, reconstruction_error
from rq_jax.cache.schemes import pick
from rq_jax.cli import ArgumentParser, positive_int
from rq_jax.data import Addition, Retrieval, collate

DIRECT, RESIDUAL = "direct INT2 g32", "+residual α=1 g32"


def task_rows(task: str, n: int, seed: int) -> np.ndarray:
    """`n` held-out rows [n, T] of one length: additions, or 43-pair retrieval sequences."""
    if task == "addition":
        add = Addition()
        return collate(add.examples("eval", n, seed), add.length)[0]
    ret = Retrieval()
    return collate(ret.examples("eval", n, seed, num_pairs=ret.max_pairs), ret.max_length(ret.max_pairs))[0]


def measure(model, tokens: np.ndarray, loops: int) -> dict:
    """Similarity and NMSE figures of one task's rows (see the module docstring), JSON-able."""
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
    lines = [header, ""]
    for task, r in results.items():
        loops, layers = np.asarray(r["k_cos"]).shape
        lines += [f"## {task}", "", "| loop | layer | K cos | K rel | V cos | V rel |", "|---|---|---|---|---|---|"]
        for loop in range(loops):
            for layer in range(layers):
                cells = " | ".join(f"{r[key][loop][layer]:.3f}" for key in ("k_cos", "k_rel", "v_cos", "v_rel"))
                lines.append(f"| {loop + 1} | {layer} | {cells} |")
        lines += ["", "NMSE ×10³ of INT2 g32 (all layers), direct against residual on the last-loop anchor (α = 1, "
                      "no rotation), and residual / direct:", "",
                  "| loop | K direct | K residual | K ratio | V direct | V residual | V ratio |",
                  "|---|---|---|---|---|---|---|"]
        for loop in range(loops):
            cells = [f"{1e3 * r[f'{k}_nmse_{w}'][loop]:.1f}" if w != "ratio" else f"{r[f'{k}_nmse_ratio'][loop]:.2f}"
                     for k in "kv" for w in ("direct", "residual", "ratio")]
            lines.append(f"| {loop + 1} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


CARD_SECTION = "## Loop similarity"


def card_section(results: dict, rows: int, seed: int) -> str:
    """The model card's section: per task and loop, mean K/V cosine to the anchor and the NMSE ratio."""
    lines = [CARD_SECTION, "",
             f"`scripts/kv_similarity.py` on {rows} held-out rows per task (seed {seed}): each loop's mean cosine to "
             "its group's last loop (the anchor), and the key / value NMSE of residual INT2 g32 on the anchor over "
             "that of direct INT2 g32 (the paper's Table 1 statistic; Ouro-1.4B keys 0.30 / 0.16 / 0.11).", "",
             "| task | loop | K cos | V cos | K residual / direct | V residual / direct |", "|---|---|---|---|---|---|"]
    for task, r in results.items():
        for loop in range(len(r["k_cos"]) - 1):
            lines.append(f"| {task} | {loop + 1} | {np.mean(r['k_cos'][loop]):.3f} | {np.mean(r['v_cos'][loop]):.3f} | "
                         f"{r['k_nmse_ratio'][loop]:.2f} | {r['v_nmse_ratio'][loop]:.2f} |")
    return "\n".join(lines) + "\n"


def write_card(folder: str, section: str) -> None:
    """Put `section` into `folder`/README.md in place of an earlier one (or at the end)."""
    path = os.path.join(folder, "README.md")
    text = open(path).read() if os.path.exists(path) else ""
    start = text.find(CARD_SECTION)
    if start < 0:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    else:
        end = text.find("\n## ", start + len(CARD_SECTION))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    with open(path, "w") as f:
        f.write(text)


def heatmap(results: dict, prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(f"{prefix}.png", dpi=130)
    plt.close(fig)


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or cached hub id")
    p.add_argument("--loops", type=positive_int, help="loops / recurrence steps (default: the config's)")
    p.add_argument("--rows", type=positive_int, default=16, help="held-out rows per task")
    p.add_argument("--tasks", default="retrieval,addition", help="comma-separated: retrieval, addition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output prefix: PREFIX.md, PREFIX.json, PREFIX.png")
    p.add_argument("--card", action="store_true",
                   help="also write the ratios into the checkpoint's README.md (a local checkpoint folder)")
    args = p.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in ("retrieval", "addition")]
    if bad or not tasks:
        p.error(f"--tasks takes retrieval and/or addition, got {args.tasks!r}")
    if args.card and not os.path.isdir(args.checkpoint):
        p.error(f"--card writes into a local checkpoint folder; {args.checkpoint} is not one")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        model, _ = checkpoint.load(args.checkpoint)
    except (OSError, ValueError) as err:
        p.error(f"--checkpoint {args.checkpoint}: {err}")
    if model.config.vocab_size < 259:
        p.error(f"--checkpoint {args.checkpoint}: needs the byte-level vocabulary of the task data (259 ids), "
                f"got {model.config.vocab_size}")
    loops = args.loops or model.config.num_loops
    results = {t: measure(model, task_rows(t, args.rows, args.seed), loops) for t in tasks}
    header = (f"# Loop similarity of {args.checkpoint} ({model.config.family}, {model.config.num_layers} layers × "
              f"{loops} loops, groups of 4), {args.rows} held-out rows per task")
    text = markdown(results, header)
    print(text)
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump(dict(checkpoint=args.checkpoint, loops=loops, rows=args.rows, seed=args.seed, tasks=results), f,
                  indent=2)
    heatmap(results, args.out)
    if args.card:
        write_card(args.checkpoint, card_section(results, args.rows, args.seed))
    print(f"wrote {args.out}.md, {args.out}.json, {args.out}.png", file=sys.stderr)


if __name__ == "__main__":
    main()
