"""Allocate a ResidualQuant cache's bits per loop and per K/V under a budget; writes the schedule artifact.

    python scripts/allocate.py --checkpoint checkpoints/ouro-small --budget 2.6 3.1 3.6 --out schedules/ouro

Measures, on the data's calib split (`rq_jax.calibrate.data`), the KL from the dense model's next-token
distributions (at every position, or with `--kl-on answers` at the addition and retrieval answers' tokens)
through the cache of each single-slot change from the richest schedule, picks the
schedule with the least summed KL within each budget (exhaustive search; the single-slot costs are
measured once for all budgets), and measures it end to end beside the paper's rule at about the same
bits ([2,2,2,4] g32, or residual INT2 g32 below 3.09 bits); see `rq_jax.calibrate.allocate`. Each
artifact, PREFIX-BUDGET.json, is a residual format's policy: pass it to `generate.py --schedule FILE`,
`serve.py --schedule FILE` or `eval.py --schedule FILE` (a row per schedule, with its CI).
"""

from __future__ import annotations

import json
import os
import sys

from rq_jax import checkpoint, cli
from rq_jax.calibrate.allocate import OPTIONS, MeasuredKL, allocate, measure_kl, paper_rule, save_schedule
from rq_jax.calibrate.data import calibration_set
from rq_jax.data import TASKS


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True, help="model folder (HF or saved) or cached hub id")
    p.add_argument("--budget", type=cli.positive_float, nargs="+", required=True,
                   help="bits per element (codes + metadata + α), one schedule each")
    p.add_argument("--out", required=True, help="output prefix: PREFIX-BUDGET.json per budget")
    p.add_argument("--rows", type=cli.positive_int, default=16, help="calib rows (fit part)")
    p.add_argument("--seq-len", type=cli.positive_int, default=128, help="tokens per calib row")
    p.add_argument("--prefix", type=cli.positive_int, default=32, help="tokens prefilled before token-by-token scoring")
    p.add_argument("--batch", type=cli.positive_int, default=16, help="rows per scoring call")
    p.add_argument("--loops", type=cli.positive_int, help="loops / recurrence steps (default: the config's)")
    p.add_argument("--seed", type=int, default=0, help="calib rows' seed")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help="the calib split's tasks the rows cycle through, e.g. addition,retrieval")
    p.add_argument("--kl-on", choices=("all", "answers"), default="all",
                   help="the positions whose KL the allocator minimises: every scored token, or only the answer tokens "
                        "of the addition and retrieval rows (the tokens the tasks' accuracy scores)")
    p.add_argument("--options", default=",".join(f"{b}g{g}" for b, g in OPTIONS),
                   help="the (bits, group size) a slot may take, e.g. 0g32,2g32,4g32 (the last: the reference; 0 bits: "
                   "the slot keeps only its α and reads its reference scaled, never at the anchor)")
    p.add_argument("--quiet", action="store_true", help="no line per measured schedule")
    args = p.parse_args(argv)
    try:
        options = tuple((int(b), int(g)) for b, g in (o.split("g") for o in args.options.split(",")))
    except ValueError:
        p.error(f"argument --options: {args.options}: expected BITSgGROUP,... e.g. 2g32,4g32")
    if len(options) < 2:
        p.error(f"argument --options: {args.options}: give at least two options")
    if options[-1][0] == 0:
        p.error(f"argument --options: {args.options}: the last option is the reference every slot starts from "
                "and cannot be 0 bits")
    if args.prefix >= args.seq_len:
        p.error(f"--prefix {args.prefix} must be below --seq-len {args.seq_len}")
    tasks = tuple(args.tasks.split(","))
    try:
        calib = calibration_set("fit", args.rows, args.seq_len, seed=args.seed, tasks=tasks)
    except ValueError as err:
        p.error(f"calib rows (--rows {args.rows}, --seq-len {args.seq_len}, --tasks {args.tasks}): {err}")
    rows, mask = calib.tokens, None
    if args.kl_on == "answers":
        mask = calib.answers
        if not mask[:, args.prefix:].any():
            p.error(f"--kl-on answers: the calib rows (--tasks {args.tasks}, --rows {args.rows}) have no answer "
                    f"token past the {args.prefix}-token prefix")
    cli.output_file(p, "--out", args.out)
    try:
        model, _ = checkpoint.load(args.checkpoint)
    except (OSError, ValueError) as err:
        p.error(f"--checkpoint {args.checkpoint}: {err}")
    loops = args.loops or model.config.num_loops
    if loops % 4:
        p.error(f"--loops {loops}: the allocator's schedules are groups of 4 loops")
    if any(model.config.head_dim % g for _, g in options):
        sizes = sorted({g for _, g in options})
        p.error(f"--checkpoint {args.checkpoint}: head_dim {model.config.head_dim} is not divisible by the group sizes "
                f"{sizes}")
    kwargs = dict(num_loops=loops, prefix=args.prefix, batch=args.batch, mask=mask)

    record = f"{args.out}-measured.json"  # every KL measured so far: a rerun with the same settings resumes
    settings = dict(checkpoint=os.path.abspath(args.checkpoint), loops=loops, rows=args.rows, seq_len=args.seq_len,
                    prefix=args.prefix, seed=args.seed)
    if tasks != TASKS:  # these two are absent from the records of runs with the defaults
        settings["tasks"] = list(tasks)
    if args.kl_on != "all":
        settings["kl_on"] = args.kl_on
    try:
        measured = MeasuredKL(record, settings, log=lambda line: args.quiet or print(line, file=sys.stderr, flush=True))
    except ValueError as err:
        p.error(f"argument --out: {err}")

    try:
        allocs = allocate(model, rows, args.budget, options=options, measured=measured, progress=measured.add,
                          **kwargs)
    except ValueError as err:
        p.error(f"--budget: {err}")
    print(f"{loops} loops, {args.rows} calib rows ({args.tasks}) of {args.seq_len} tokens ({args.prefix} prefilled), "
          f"KL on {args.kl_on} positions, {allocs[-1].seconds:.0f} s")
    print("| budget | schedule | bits/elem | KL to dense (measured) | predicted | paper's rule | its bits | its KL |\n"
          "|---|---|---|---|---|---|---|---|")
    written = []
    for alloc in allocs:
        rule = paper_rule(alloc.budget)
        rule_bits = float(rule.bits_per_element(loops, model.config.head_dim))
        label = f"rule {rule.schedule_name(loops)}"
        if label not in measured:
            measured.add(label, measure_kl(model, rule, rows, args.prefix, args.batch, mask=mask, num_loops=loops))
        rule_kl = measured[label]
        path = f"{args.out}-{alloc.budget:g}.json"
        save_schedule(path, alloc.schedule, {}, dict(
            allocation=alloc.to_json(), checkpoint=args.checkpoint, loops=loops, rows=args.rows,
            seq_len=args.seq_len, prefix=args.prefix, seed=args.seed, tasks=list(tasks), kl_on=args.kl_on,
            rule=dict(bits=rule_bits, kl=rule_kl, schedule=rule.schedule_name(loops))))
        written.append(os.path.abspath(path))
        print(f"| {alloc.budget:g} | {alloc.schedule.label()} | {alloc.bits:.4f} | {alloc.kl:.3e} | "
              f"{alloc.predicted_kl:.3e} | {rule.schedule_name(loops)} | {rule_bits:.4f} | {rule_kl:.3e} |")
    print(f"reference {allocs[0].reference.label()}: KL {allocs[0].reference_kl:.3e}")
    print(json.dumps({"out": written}))


if __name__ == "__main__":
    main()
