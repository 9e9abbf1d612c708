"""Registers, spills, shared memory and tensor-core use of every shipped decode-kernel configuration,
compiled for Hopper (sm_90) and Ampere (sm_80) without a GPU; markdown + JSON.

    python scripts/kernel_report.py --json kernels.json --markdown kernels.md       # the whole matrix
    python scripts/kernel_report.py --only huginn ouro                              # names containing these
    python scripts/kernel_report.py --ci-subset                                     # what the tests compile
    python scripts/kernel_report.py --sweep --json sweep.json                       # re-derive launch.TABLE
    python scripts/kernel_report.py --refit kernels.json                            # fix the classes that spill
    python scripts/kernel_report.py --shard 0/2 & python scripts/kernel_report.py --shard 1/2   # in parallel

Each configuration of `pallas_kernels.configs.MATRIX` (every call the dispatch can make for the shipped
cache policies) is lowered by jax for the "cuda" platform at the target's compute capability and run
through the pip `triton` wheel's CUDA stages and its ptxas (`pallas_kernels.deviceless`), with the
launch parameters the dispatch picks (`pallas_kernels.launch`). Results are cached by IR hash
(--cache, default $RQ_KERNEL_CACHE or ~/.cache/rq_jax/kernels), so a rerun only compiles what changed.
The exit status is 1 when any configuration spills, needs more shared memory than its target has, or
does not compile.

What the rows hold, and how --sweep and --refit search: `pallas_kernels/report.py`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import configs, deviceless, report  # noqa: E402
from rq_jax import cli  # noqa: E402
from rq_jax.report import write_text  # noqa: E402


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(deviceless.TARGETS), choices=list(deviceless.TARGETS))
    p.add_argument("--only", nargs="+", default=None, help="configurations whose name contains any of these")
    p.add_argument("--ci-subset", action="store_true", help="only configs.CI_SUBSET (what the tests compile)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="only every N-th configuration (--sweep: family of classes) from the I-th (0-based)")
    p.add_argument("--cache", default=None, help="compile cache directory (default: deviceless.default_cache_dir())")
    p.add_argument("--sweep", action="store_true", help="derive launch.TABLE instead of reporting the matrix")
    p.add_argument("--refit", metavar="REPORT", default=None,
                   help="a report's JSON: find launch parameters for the classes that failed there")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if not deviceless.triton_available():
        print("kernel_report.py needs the pip `triton` wheel: pip install -e '.[test]'", file=sys.stderr)
        return 2
    targets = [deviceless.TARGETS[t] for t in args.targets]
    cfgs = [c for c in configs.MATRIX if args.only is None or any(s in c.name for s in args.only)]
    if args.ci_subset:
        cfgs = [c for c in cfgs if c.name in configs.CI_SUBSET]
    i, n = map(int, args.shard.split("/")) if args.shard else (0, 1)
    versions = deviceless.toolchain_versions()
    start = time.perf_counter()
    if args.refit or args.sweep:
        if args.refit:
            try:
                keys = report.failed_keys(args.refit)[i::n]
            except ValueError as err:
                p.error(f"--refit {args.refit}: {err}")
            out = report.refit(keys, targets, args.cache)
        else:
            keys = {c.launch_key() for c in cfgs} - {None}
            families = sorted({report.family(k) for k in keys})[i::n]
            out = report.sweep([k for k in keys if report.family(k) in families], targets, args.cache)
        print(report.table_source(out["table"], "OVERRIDES" if args.refit else "TABLE"))
        result = dict(versions=versions, table=report.table_json(out["table"]), rows=out["rows"])
        failed = any(v is None for v in out["table"].values())
    else:
        rows = report.report(cfgs[i::n], targets, args.cache)
        result = dict(versions=versions, rows=rows)
        failed = not all(r["ok"] for r in rows)
        print(report.summary(rows))
        if args.markdown:
            write_text(args.markdown, report.markdown(rows, versions))
    print(f"{time.perf_counter() - start:.0f} s; {versions}")
    if args.json:
        write_text(args.json, json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
