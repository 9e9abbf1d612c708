"""How alike a looped model's loops are: per layer and loop, each loop's K/V against its group's last loop
(the anchor ResidualQuant codes the others against), and the paper's Table 1 statistic; Markdown + JSON +
a heatmap.

    python scripts/kv_similarity.py --checkpoint checkpoints/ouro-small --out docs/results/ouro-similarity

On held-out rows of each task: per layer and loop the mean cosine of a loop's K (or V) to the anchor's
(cos) and what least-squares residual coding leaves of it (rel), and per loop the NMSE of INT2 g32 coded
directly and as a residual on the anchor, with their ratio (the paper's Table 1: Ouro-1.4B keys 0.30 /
0.16 / 0.11); the figures are defined in `rq_jax.eval.kv_similarity`. With --card the NMSE ratios also
go into the checkpoint's model card (README.md), as its "Loop similarity" section.
"""

from __future__ import annotations

import json
import os
import sys

from rq_jax import checkpoint, report
from rq_jax.eval import kv_similarity
from rq_jax.cli import ArgumentParser, positive_int


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
    bad = [t for t in tasks if t not in kv_similarity.TASKS]
    if bad or not tasks:
        p.error(f"--tasks takes retrieval and/or addition, got {args.tasks!r}")
    if args.card and not os.path.isdir(args.checkpoint):
        p.error(f"--card writes into a local checkpoint folder; {args.checkpoint} is not one")
    try:
        model, _ = checkpoint.load(args.checkpoint)
    except (OSError, ValueError) as err:
        p.error(f"--checkpoint {args.checkpoint}: {err}")
    if model.config.vocab_size < 259:
        p.error(f"--checkpoint {args.checkpoint}: needs the byte-level vocabulary of the task data (259 ids), "
                f"got {model.config.vocab_size}")
    loops = args.loops or model.config.num_loops
    results = {t: kv_similarity.measure(model, kv_similarity.task_rows(t, args.rows, args.seed), loops)
               for t in tasks}
    header = (f"# Loop similarity of {args.checkpoint} ({model.config.family}, {model.config.num_layers} layers × "
              f"{loops} loops, groups of 4), {args.rows} held-out rows per task")
    text = kv_similarity.markdown(results, header)
    print(text)
    report.write_text(f"{args.out}.md", text + "\n")
    report.write_text(f"{args.out}.json", json.dumps(dict(checkpoint=args.checkpoint, loops=loops, rows=args.rows,
                                                          seed=args.seed, tasks=results), indent=2))
    kv_similarity.heatmap(results, f"{args.out}.png")
    if args.card:
        kv_similarity.write_card(args.checkpoint, kv_similarity.card_section(results, args.rows, args.seed))
    print(f"wrote {args.out}.md, {args.out}.json, {args.out}.png", file=sys.stderr)


if __name__ == "__main__":
    main()
