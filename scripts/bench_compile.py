"""Compile time of one jitted decode step at real depth and reduced width; prints a table, writes JSON.

    python scripts/bench_compile.py [--json out.json]

For Ouro-1.4B's depth (24 layers × 4 loops) and Huginn-0125's (2 prelude + 4 core + 2 coda blocks,
32 recurrence steps), at full and half depth, a randomly initialised model of reduced width decodes one
token against a `--context`-token cache, with the `dense` and `residual` formats. "first call" is trace
+ compile + one run of a fresh `jax.jit`; "step" the median of later calls. The "before" column is the
unrolled engine's first call measured on this 2-core CPU when the scan engine was proposed (issue 7);
the scan engine's trace does not grow with depth. The measurement: `rq_jax.perf.compile_time`.
"""

import json

from rq_jax import cli, report
from rq_jax.cache import available_formats
from rq_jax.compilation import quiet_xla
from rq_jax.config import PRESETS
from rq_jax.perf import compile_time


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--width", type=cli.positive_int, default=256, help="hidden size (heads x head dim)")
    p.add_argument("--head-dim", type=cli.positive_int, default=128, help="head dim (divides --width)")
    p.add_argument("--context", type=cli.positive_int, default=64, help="tokens cached")
    p.add_argument("--repeats", type=cli.positive_int, default=5, help="timed calls after the first (median)")
    p.add_argument("--models", default="ouro-1.4b,huginn-0125", help="comma-separated presets")
    p.add_argument("--formats", default="dense,residual", help="comma-separated cache formats")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.width % args.head_dim:
        p.error(f"argument --head-dim: {args.head_dim} does not divide --width {args.width}")
    bad = [m for m in args.models.split(",") if m not in PRESETS]
    if bad:
        p.error(f"argument --models: {', '.join(bad)}; the presets are {', '.join(sorted(PRESETS))}")
    bad = [f for f in args.formats.split(",") if f not in available_formats()]
    if bad:
        p.error(f"argument --formats: {', '.join(bad)}; the formats are {', '.join(available_formats())}")
    if args.json:
        cli.output_file(p, "--json", args.json)
    quiet_xla()  # and no persistent compile cache: this script measures compilation
    rows = compile_time.depth_rows(args.models.split(","), args.formats.split(","), args.width, args.head_dim,
                                   args.context, args.repeats)
    if args.json:
        report.write_text(args.json, json.dumps(compile_time.result(vars(args), rows), indent=2))


if __name__ == "__main__":
    main()
