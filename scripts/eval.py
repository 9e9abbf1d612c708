"""Accuracy versus memory of every cache format on the held-out tasks; Markdown + JSON + figures.

    python scripts/eval.py --model ouro --out results/ouro

Without --checkpoint it scores the shipped base model of --model (checkpoints/ouro-small or
checkpoints/huginn-small: the models as trained, also generate.py's defaults); with --checkpoint,
--model may be left out.

Each row scores the eval split through that format's cache (`rq_jax.scoring`): exact match of
greedy answers (addition, 43-pair retrieval) with a paired-bootstrap 95% CI of the difference to a
float32 dense cache, agreement with the dense greedy tokens, answer NLL, KL to the dense next-token
distributions and stdlib bits per byte, beside bits per element and cache bytes per token. Writes
PREFIX.md, PREFIX.json, PREFIX_accuracy.png (accuracy vs bits per element) and PREFIX_kv_error.png
(K/V reconstruction error per layer and loop of the `[2,2,2,4]` format on retrieval prompts); the
output folder is created first. The progress bar counts answers (sums, retrieval queries, text
windows) as their batches finish.
"""

import dataclasses
import json
import os
import platform
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from rq_jax import checkpoint, cli, memory, sharding
from rq_jax.cache import get_format
from rq_jax.cache.kv_error import dense_kv, reconstruction_error
from rq_jax.cache.schemes import calibrated_schemes, rival_schemes, table_schemes
from rq_jax.data import collate
from rq_jax import scoring
from rq_jax.eval.table import Tasks, evaluate, pareto_front

#: The checkpoint each --model scores without --checkpoint: the shipped base models.
EVAL_CHECKPOINT = {"huginn": "huginn-small", "ouro": "ouro-small"}


def parse_args(argv=None):
    from rq_jax.calibrate import METHODS

    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=("huginn", "ouro"),
                   help="model family: scores checkpoints/huginn-small or checkpoints/ouro-small without --checkpoint "
                   "(default: the family --checkpoint's config names)")
    p.add_argument("--checkpoint", help="checkpoint folder (default: the shipped base model of --model)")
    p.add_argument("--loops", type=cli.positive_int, help="loops / recurrence steps (default: the config's)")
    p.add_argument("--n", type=cli.positive_int, default=1000,
                   help="held-out answers per task (addition examples, retrieval queries)")
    p.add_argument("--retrieval-pairs", type=cli.positive_int, default=43,
                   help="key-value pairs of every retrieval example")
    p.add_argument("--text-windows", type=cli.positive_int, default=64, help="stdlib windows for bits per byte")
    p.add_argument("--batch", type=cli.positive_int, default=64,
                   help="rows per compiled call (a multiple of the mesh's data size)")
    p.add_argument("--group-sizes", type=cli.int_list, default=(32, 16), help="group sizes of the ablation ladder")
    labels = ", ".join(s.label for s in table_schemes((32, 16)))
    p.add_argument("--only", action="append", metavar="TEXT",
                   help=f"keep the schemes whose label contains TEXT (repeatable); the labels at the default group "
                   f"sizes: {labels}; with --rotations also 'rotated INT2 g32 oscar', '+rotation g32 oscar', "
                   "'[2,2,2,4] g32 oscar' and the same per group size and method; a --schedule's row: "
                   "'allocated NAME' (its file's name)")
    p.add_argument("--rotations", default="", help=f"comma-separated calibration methods ({', '.join(METHODS)}) to "
                   "add as rows beside Hadamard, fitted on the calib split's fit/holdout rows")
    p.add_argument("--rivals", action="store_true", help="add the rivals' rows: loop KV sharing, Huginn's "
                   "compress strategies and vLLM's turboquant presets "
                   f"({', '.join(s.label for s in rival_schemes())}; at the first group size)")
    p.add_argument("--calibration-rows", type=cli.positive_int, default=32, help="fit and holdout rows for --rotations")
    p.add_argument("--calibration", help="folder of saved calibration artifacts (scripts/calibrate.py): rows whose "
                   "schedule has one use it (label suffixed with its method)")
    p.add_argument("--schedule", action="append", default=[], metavar="FILE",
                   help="add a row per bit-allocation schedule (scripts/allocate.py); repeatable")
    p.add_argument("--compare", action="append", default=[], metavar="LABEL",
                   help="add a table of every row's accuracy minus row LABEL's on the same answers, with its "
                   "paired-bootstrap 95%% CI (repeatable; LABEL as --only lists it, before a --calibration suffix)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.md, PREFIX.json, PREFIX_*.png (its folder is "
                   "created)")
    p.add_argument("--resume", action="store_true", help="keep the rows PREFIX.json already holds from a run with the "
                   "same model and data settings (it is rewritten after every row) and score only the others")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; one line per finished row instead")
    cli.add_runtime_options(p)
    args = p.parse_args(argv)
    args.rotations = tuple(m for m in args.rotations.split(",") if m)
    bad = [m for m in args.rotations if m not in METHODS]
    if bad:
        p.error(f"argument --rotations: {', '.join(bad)}; the methods are {', '.join(METHODS)}")
    if any(g < 1 for g in args.group_sizes):
        p.error(f"argument --group-sizes: must be positive, got {','.join(map(str, args.group_sizes))}")
    return p, args


def saved_calibration(folder: str, model, scheme, loops: int):
    """The artifact under `folder` for the scheme's schedule: (its CacheCalib, method), or None."""
    from rq_jax.calibrate import find_artifact, load_calibration, read_artifact

    try:
        path = find_artifact(folder, scheme.fmt, loops)
    except ValueError:
        return None
    return load_calibration(path, model, scheme.fmt, num_loops=loops), read_artifact(path)[0]["method"]


def finished_rows(p, path: str, settings: dict) -> dict[str, dict]:
    """Rows of an earlier run's JSON at `path`, by scheme label; {} when there is none. `p.error` when
    that run scored other data or another model (its `settings` differ)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        earlier = json.load(f)
    theirs = {k: earlier["meta"].get(k) for k in settings}
    if theirs != settings:
        p.error(f"argument --resume: {path} was written with {theirs}, not {settings}")
    return {r["scheme"]: r for r in earlier["rows"]}


def write_json(path: str, meta: dict, rows: list[dict], **extra) -> None:
    """The run's JSON: its settings, its rows so far, and `extra` (the final write adds kv_error)."""
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, **extra), f, indent=2)


def fmt_ci(m: dict) -> str:
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
    fitted = [r for r in rows if "calibration" in r]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator

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
    fig.savefig(f"{prefix}_accuracy.png", dpi=150)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, name in zip(axes, ("k", "v")):
        err = np.asarray(kv_err[f"{name}_layer"]).T  # [layers, loops]
        im = ax.imshow(err, aspect="auto", cmap="viridis", origin="lower")
        ax.set(xlabel="loop", ylabel="layer", title=f"{name.upper()} NMSE, {kv_err['scheme']}")
        ax.set_xticks(range(loops))
        ax.set_yticks(range(err.shape[0]))
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(f"{prefix}_kv_error.png", dpi=150)
    plt.close("all")


def main(argv=None):
    p, args = parse_args(argv)
    if args.checkpoint is None and args.model is None:
        p.error("give --model huginn or --model ouro (the shipped small models), or --checkpoint DIR")
    source = args.checkpoint or os.path.relpath(os.path.join(checkpoint.SHIPPED, EVAL_CHECKPOINT[args.model]))
    try:
        config, folder = checkpoint.read_config(source)
    except (OSError, ValueError) as err:
        p.error(f"argument --checkpoint: {err}")
    if args.model is not None and config.family != args.model:
        p.error(f"argument --model: {args.model}, but --checkpoint {source} holds a {config.family} model "
                f"(leave --model out to take the checkpoint's)")
    cli.check_group_sizes(p, "--group-sizes", args.group_sizes, config.head_dim)
    tasks = Tasks(n=args.n, retrieval_pairs=args.retrieval_pairs, text_windows=args.text_windows)
    rows_to_run = table_schemes(args.group_sizes) + calibrated_schemes(args.group_sizes, args.rotations)
    if args.rivals:
        rows_to_run += rival_schemes(args.group_sizes[0])
    for path, scheme in zip(args.schedule, cli.schedule_schemes(p, args.schedule)):
        cli.check_format(p, f"--schedule {path}", scheme.fmt, config, args.loops or config.num_loops)
        rows_to_run.append(scheme)
    if args.only:
        labels = ", ".join(s.label for s in rows_to_run)
        rows_to_run = [s for s in rows_to_run if any(k in s.label for k in args.only)]
        if not rows_to_run:
            p.error(f"argument --only: {', '.join(args.only)} matches no scheme; the labels are {labels}")
    missing = [c for c in args.compare if c not in {s.label for s in rows_to_run}]
    if missing:
        p.error(f"argument --compare: {', '.join(missing)} is not a row of this run; its rows are "
                f"{', '.join(s.label for s in rows_to_run)}")
    cli.output_file(p, "--out", args.out)
    cli.start(args)
    mesh = cli.device_mesh(p, args)
    if args.batch % sharding.axis_size(mesh, "data"):
        p.error(f"argument --batch: {args.batch} is not a multiple of the mesh's data axis "
                f"({sharding.axis_size(mesh, 'data')})")
    loops = args.loops or config.num_loops
    settings = dict(checkpoint=os.path.abspath(folder), family=config.family, loops=loops, n=args.n,
                    retrieval_pairs=args.retrieval_pairs, text_windows=args.text_windows,
                    python=platform.python_version())
    done = finished_rows(p, f"{args.out}.json", settings) if args.resume else {}
    model, _ = checkpoint.load(folder)
    length = max(Tasks().text_len,
                 Tasks(retrieval_pairs=args.retrieval_pairs).retrieval.max_length(args.retrieval_pairs))
    try:  # the format's cache and the float32 dense reference, a batch of the longest rows
        memory.check_fits(model, get_format("dense", dtype="float32"), batch=args.batch, prompt_len=length,
                          max_len=length, num_loops=loops, caches=2, what="this eval", advice="use a smaller --batch")
    except MemoryError as err:
        p.error(str(err))
    per_row = tasks.num_answers()
    bar = tqdm(total=per_row * len(rows_to_run), disable=args.no_progress, desc="eval", unit="answer")
    command = "python scripts/eval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    writer = not jax.process_index()  # several processes: the first writes the results
    rows = []

    def progress(status: str, answers: int) -> None:
        bar.set_postfix_str(status, refresh=False)
        bar.update(answers)

    compare = {label: label for label in args.compare}  # --compare's label → its row's (with a --calibration suffix)
    for scheme in rows_to_run:
        calib, extra = None, {}
        if args.calibration and not scheme.method and scheme.fmt.needs_calib and (
                found := saved_calibration(args.calibration, model, scheme, loops)):
            calib, method = found
            if scheme.label in compare:
                compare[scheme.label] = f"{scheme.label} {method}"
            scheme = dataclasses.replace(scheme, label=f"{scheme.label} {method}", method=method)
        if scheme.label in done:
            rows.append(done[scheme.label])
            bar.update(per_row)
            continue
        start = time.perf_counter()
        if calib is None and scheme.method:  # a --rotations row (a saved artifact's row has its calib)
            progress(f"{scheme.label}: calibrating", 0)
            from rq_jax.calibrate import fit_rotations

            calib, extra["calibration"] = fit_rotations(model, scheme.fmt, scheme.method, loops,
                                                        rows=args.calibration_rows)
        row = evaluate(model, scheme, tasks, batch=args.batch, calib=calib, mesh=mesh, num_loops=loops,
                       progress=progress)
        rows.append({**row, **extra, "seconds": time.perf_counter() - start})
        if args.no_progress:
            print(f"eval: {scheme.label}: addition {100 * row['addition']['accuracy']:.1f}%, retrieval "
                  f"{100 * row['retrieval']['accuracy']:.1f}%, {row['text']['bpb']:.3f} bpb, "
                  f"{rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        if writer:  # what a --resume run keeps
            write_json(f"{args.out}.json", dict(settings, command=command), rows)
    bar.close()
    mixed = next((s for s in table_schemes(args.group_sizes) if s.label.startswith("[2,2,2,4]")))
    examples = tasks.retrieval.examples("eval", 8, tasks.seed, num_pairs=tasks.retrieval_pairs)
    prompts = collate(examples, tasks.retrieval.max_length(tasks.retrieval_pairs))[0]
    k, v = dense_kv(model, jnp.asarray(prompts), loops)
    err = reconstruction_error(mixed.fmt, k, v)
    kv_err = {"scheme": mixed.label, **{name: np.asarray(x).tolist() for name, x in err.items()}}
    meta = dict(settings, seconds=sum(r.get("seconds", 0.0) for r in rows), command=command)  # older files: no timings
    header = (f"# {config.family} ({meta['checkpoint']}), {loops} loops; {args.n} held-out examples per task, "
              f"{args.retrieval_pairs}-pair retrieval, {args.text_windows} stdlib windows (Python {meta['python']})\n\n"
              "Accuracy: exact match through the cache, with the 95% paired-bootstrap CI of its difference to the "
              "float32 dense cache.")
    if not writer:
        return rows
    text = markdown(rows, header, tuple(compare.values()))
    print(text)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    write_json(f"{args.out}.json", meta, rows, kv_error=kv_err)
    figures(rows, kv_err, loops, args.out)
    return rows


if __name__ == "__main__":
    main()
