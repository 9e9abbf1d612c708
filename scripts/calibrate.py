"""Calibrate a cache format for a model (OptR-H or OSCAR rotations, key means, RVQ codebooks).

    python scripts/calibrate.py --checkpoint checkpoints/ouro-small --cache residual --bits 2,2,2,4 \\
        --group-size 32 --method optr-h

Runs the model over calibration rows from the data generators' "calib" split (fit and holdout parts,
disjoint from each other and from evaluation data), fits the format's calibration, prints the per-head
holdout losses before (default rotation) and after, and saves the artifact (default:
<checkpoint>/calibration/<schedule>-<method>/) for `rq_jax.calibrate.load_calibration`. Options,
the checkpoint and the output folder are checked before any work.
"""

import os

from rq_jax import checkpoint, cli
from rq_jax.cache import available_formats, get_format
from rq_jax.cache.base import policy_fields
from rq_jax.calibrate import METHODS, OptRHConfig, calibrate_model, calibration_set, save_calibration
from rq_jax.calibrate.allocate import load_schedule
from rq_jax.calibrate.data import reads_calibration_data
from rq_jax.calibrate.pipeline import holdout_table
from rq_jax.data import TASKS
from rq_jax.tokenizer import load_tokenizer

#: Formats that read a calibration (the others have nothing to fit).
FORMATS = sorted(name for name in available_formats() if get_format(name).needs_calib)


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True, help="model folder (HF or saved) or cached hub id")
    p.add_argument("--cache", choices=FORMATS, default="residual", help="cache format to calibrate")
    p.add_argument("--bits", type=cli.int_list, help="bits per loop of a group, e.g. 2,2,2,4; default the format's")
    p.add_argument("--group-size", type=cli.int_list,
                   help="channel group size, or one per loop, each a divisor of head_dim; default the format's")
    p.add_argument("--schedule", metavar="FILE",
                   help="residual: fit for a bit-allocation schedule (scripts/allocate.py), not --bits / --group-size")
    p.add_argument("--method", choices=METHODS, default="optr-h", help="rotation method (LoopQuant formats)")
    p.add_argument("--out", help="artifact folder (default <checkpoint>/calibration/<schedule>-<method>)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact folder")
    p.add_argument("--loops", "--num-steps", dest="loops", type=cli.positive_int,
                   help="loops; default the config's")
    p.add_argument("--steps", type=cli.positive_int, default=80, help="OptR-H Adam steps")
    p.add_argument("--lr", type=cli.positive_float, default=0.02, help="OptR-H learning rate")
    p.add_argument("--rows-per-step", type=cli.positive_int, default=2, help="OptR-H fit rows per step")
    p.add_argument("--query-len", type=cli.positive_int, default=64, help="query positions per row (last ones)")
    p.add_argument("--candidate-every", type=cli.positive_int, default=20,
                   help="OptR-H checkpoints kept as holdout-selection candidates")
    p.add_argument("--no-key-means", dest="key_means", action="store_false", help="OptR-H without key means")
    p.add_argument("--fit-rows", type=cli.positive_int, default=128, help="calibration rows to fit on")
    p.add_argument("--holdout-rows", type=cli.positive_int, default=128, help="rows to select and report on")
    p.add_argument("--seq-len", type=cli.positive_int, default=256, help="tokens per calibration row")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--seed", type=int, default=0, help="data, row order and Huginn initial-state seed")
    p.add_argument("--batch-size", type=cli.positive_int, default=8, help="rows per forward pass when collecting")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    cli.add_runtime_options(p)
    return p, p.parse_args(argv)


def main(argv=None):
    p, args = parse_args(argv)
    fields = policy_fields(args.cache)
    given = [k for k in ("bits", "group_size") if getattr(args, k) is not None and k not in fields]
    if given:
        p.error(f"--cache {args.cache} does not take {', '.join('--' + g.replace('_', '-') for g in given)}")
    policy = {k: getattr(args, k) for k in ("bits", "group_size") if getattr(args, k) is not None}
    if args.schedule is not None and (args.cache != "residual" or policy):
        p.error("--schedule FILE fixes the residual format's bits and group sizes: drop --bits / --group-size / "
                f"--cache {args.cache}")
    if len(policy.get("group_size", (0, 0))) == 1:
        policy["group_size"] = policy["group_size"][0]  # one size for every loop
    tasks = tuple(t for t in args.tasks.split(",") if t)
    try:
        config, folder = checkpoint.read_config(args.checkpoint)
    except (OSError, ValueError) as err:
        p.error(f"argument --checkpoint: {err}")
    if args.group_size is not None:
        cli.check_group_sizes(p, "--group-size", args.group_size, config.head_dim)
    loops = args.loops or config.num_loops
    what = (f"--schedule {args.schedule}" if args.schedule is not None else
            " ".join([f"--cache {args.cache}"] + [cli.spelled(k, getattr(args, k)) for k in policy]))
    try:
        fmt = load_schedule(args.schedule) if args.schedule is not None else get_format(args.cache, **policy)
    except ValueError as err:
        p.error(f"{what}: {err}")
    cli.check_format(p, what, fmt, config, loops)
    try:
        opt = OptRHConfig(steps=args.steps, lr=args.lr, rows_per_step=args.rows_per_step, query_len=args.query_len,
                          candidate_every=args.candidate_every, key_means=args.key_means, seed=args.seed)
        fit = calibration_set("fit", args.fit_rows, args.seq_len, seed=args.seed, tasks=tasks)
        holdout = calibration_set("holdout", args.holdout_rows, args.seq_len, seed=args.seed, tasks=tasks)
    except ValueError as err:
        p.error(str(err))
    tokenizer = load_tokenizer(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) else None
    if why := reads_calibration_data(config.vocab_size, tokenizer):
        p.error(f"argument --checkpoint: {why}")
    method = args.method if fmt.learns_rotations else "format"
    out = args.out or os.path.join(folder, "calibration", f"{fmt.schedule_name(loops)}-{method}")
    if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        p.error(f"argument --out: {out} exists and is not empty; pass --overwrite to replace it")
    cli.output_folder(p, "--out", os.path.dirname(os.path.abspath(out)))
    cli.start(args)
    model, _ = checkpoint.load(folder)
    cal = calibrate_model(model, fmt, fit.tokens, holdout.tokens, method=args.method, num_loops=loops, config=opt,
                          seed=args.seed, batch_size=args.batch_size, progress=not args.quiet,
                          data_info=dict(fit=fit.info, holdout=holdout.info))
    cal.meta["checkpoint"] = os.path.abspath(folder)
    c = config
    print(f"model: {args.checkpoint} ({c.family}, {c.num_layers} layers, {c.num_kv_heads} kv heads, D={c.head_dim}), "
          f"{loops} loops; cache {fmt.name} ({cal.meta['schedule']}); method {cal.meta['method']}; "
          f"{args.fit_rows} fit + {args.holdout_rows} holdout rows of {args.seq_len} tokens")
    print("\n".join(holdout_table(cal.report)))
    print(f"saved: {save_calibration(out, cal, overwrite=args.overwrite)}")


if __name__ == "__main__":
    main()
