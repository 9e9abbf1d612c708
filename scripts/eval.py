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

import os
import platform
import sys

import jax

from rq_jax import checkpoint, cli, memory, report, sharding
from rq_jax.cache import get_format
from rq_jax.cache.schemes import calibrated_schemes, rival_schemes, table_schemes
from rq_jax.calibrate import METHODS
from rq_jax.calibrate.scheme import NeedsCalibration, saved_method
from rq_jax.data import Tasks
from rq_jax.eval import table_report
from rq_jax.eval.table import loop_kv_error, run_table


def parse_args(argv=None):
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
                   "schedule has one use it (label suffixed with its method), and --rotations rows read theirs "
                   "from it instead of fitting")
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


def main(argv=None):
    p, args = parse_args(argv)
    config, folder = cli.resolve_checkpoint(p, args)
    cli.check_group_sizes(p, "--group-sizes", args.group_sizes, config.head_dim)
    loops = args.loops or config.num_loops
    tasks = Tasks(n=args.n, retrieval_pairs=args.retrieval_pairs, text_windows=args.text_windows)
    rows_to_run = table_schemes(args.group_sizes) + calibrated_schemes(args.group_sizes, args.rotations)
    rows_to_run += rival_schemes(args.group_sizes[0]) if args.rivals else []
    for path, scheme in zip(args.schedule, cli.schedule_schemes(p, args.schedule)):
        cli.check_format(p, f"--schedule {path}", scheme.fmt, config, loops)
        rows_to_run.append(scheme)
    labels = ", ".join(s.label for s in rows_to_run)
    rows_to_run = [s for s in rows_to_run if not args.only or any(k in s.label for k in args.only)]
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
    settings = dict(checkpoint=os.path.abspath(folder), family=config.family, loops=loops, n=args.n,
                    retrieval_pairs=args.retrieval_pairs, text_windows=args.text_windows,
                    python=platform.python_version())
    try:
        done = report.finished_rows(f"{args.out}.json", settings, key="scheme") if args.resume else {}
    except ValueError as err:
        p.error(f"argument --resume: {err}")
    model, _ = checkpoint.load(folder)
    try:  # the format's cache and the float32 dense reference, a batch of the longest rows
        memory.check_fits(model, get_format("dense", dtype="float32"), batch=args.batch, prompt_len=tasks.length,
                          max_len=tasks.length, num_loops=loops, caches=2, what="this eval",
                          advice="use a smaller --batch")
    except MemoryError as err:
        p.error(str(err))
    if args.calibration:  # rows that adopt a saved artifact's method take its name: --compare follows them
        named = {s.label: saved_method(s, args.calibration, loops) for s in rows_to_run}
        rows_to_run = list(named.values())
    compare = tuple(named[label].label if args.calibration else label for label in args.compare)
    command = "python scripts/eval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    writer = not jax.process_index()  # several processes: the first writes the results
    try:
        rows = run_table(model, rows_to_run, tasks, num_loops=loops, batch=args.batch, mesh=mesh,
                         calibration=args.calibration, fit_rows=args.calibration_rows, done=done,
                         show_progress=not args.no_progress,
                         on_row=lambda rows: writer and report.write_run(args.out, dict(settings, command=command),
                                                                         rows))  # what a --resume run keeps
    except NeedsCalibration as err:
        p.error(f"argument --calibration: {err}")
    mixed = next(s for s in table_schemes(args.group_sizes) if s.label.startswith("[2,2,2,4]"))
    kv_err = loop_kv_error(model, mixed, tasks, loops)
    meta = dict(settings, seconds=sum(r.get("seconds", 0.0) for r in rows), command=command)  # older files: no timings
    if writer:
        print(table_report.write(args.out, meta, rows, kv_err, loops, compare))
    return rows


if __name__ == "__main__":
    main()
