"""Registers, spills, shared memory and tensor-core use of every shipped decode-kernel configuration,
compiled for Hopper (sm_90) and Ampere (sm_80) without a GPU, or VMEM and code size compiled for TPUs
without a TPU (--tpu); markdown + JSON.

    python scripts/kernel_report.py --json kernels.json --markdown kernels.md       # the whole matrix
    python scripts/kernel_report.py --only huginn ouro                              # names containing these
    python scripts/kernel_report.py --ci-subset                                     # what the tests compile
    python scripts/kernel_report.py --sweep --json sweep.json                       # re-derive launch.TABLE
    python scripts/kernel_report.py --refit kernels.json                            # fix the classes that spill
    python scripts/kernel_report.py --page 16 --json paged.json                     # through a block table
    python scripts/kernel_report.py --shard 0/2 & python scripts/kernel_report.py --shard 1/2   # in parallel
    python scripts/kernel_report.py --tpu v5e,v6e,v4 --json tpu.json --markdown tpu.md    # TPUs (libtpu)
    python scripts/kernel_report.py --tpu v5e,v6e --page 128                        # TPUs, through a block table

Each configuration of `pallas_kernels.configs.MATRIX` (every call the dispatch can make for the shipped
cache policies) is lowered by jax for the "cuda" platform at the target's compute capability and run
through the pip `triton` wheel's CUDA stages and its ptxas (`pallas_kernels.deviceless`), with the
launch parameters the dispatch picks (`pallas_kernels.launch`). Results are cached by IR hash
(--cache, default $RQ_KERNEL_CACHE or ~/.cache/rq_jax/kernels), so a rerun only compiles what changed.
The exit status is 1 when any configuration spills, needs more shared memory than its target has, or
does not compile.

With --tpu the same configurations are compiled for TPU generations instead, by libtpu's Mosaic and
XLA:TPU compilers on this host (`pallas_kernels.tpu_deviceless`; no cache): per generation, whether each
compiles, is declined by the TPU kernel (not a failure) or fails, and its VMEM and code size. The exit
status is 1 when any fails to compile, 2 when libtpu is not installed.

What the rows hold, and how --sweep and --refit search: `pallas_kernels/report.py` (--tpu:
`pallas_kernels/tpu_report.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import configs, deviceless, report, tpu_deviceless, tpu_launch, tpu_report  # noqa: E402
from rq_jax import cli  # noqa: E402
from rq_jax.report import write_text  # noqa: E402


def generations(text: str) -> list[str]:
    """A comma-separated list of TPU generations (tpu_launch.GENERATIONS)."""
    names = text.split(",")
    if unknown := [g for g in names if g not in tpu_launch.GENERATIONS]:
        raise argparse.ArgumentTypeError(f"unknown TPU generation {', '.join(unknown)}: choose from "
                                         f"{','.join(tpu_launch.GENERATIONS)}")
    return names


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(deviceless.TARGETS), choices=list(deviceless.TARGETS))
    p.add_argument("--tpu", type=generations, default=None, metavar="GEN,GEN",
                   help="compile for these TPU generations (v4, v5e, v5p, v6e) instead of --targets")
    p.add_argument("--only", nargs="+", default=None, help="configurations whose name contains any of these")
    p.add_argument("--ci-subset", action="store_true",
                   help="only configs.CI_SUBSET (--tpu: TPU_CI_SUBSET), what the tests compile")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="only every N-th configuration (--sweep: family of classes) from the I-th (0-based)")
    p.add_argument("--cache", default=None, help="compile cache directory (default: deviceless.default_cache_dir())")
    p.add_argument("--sweep", action="store_true", help="derive launch.TABLE instead of reporting the matrix")
    p.add_argument("--refit", metavar="REPORT", default=None,
                   help="a report's JSON: find launch parameters for the classes that failed there")
    p.add_argument("--page", type=cli.positive_int, default=None, metavar="P",
                   help="every configuration read through a block table over pages of P tokens (the serving "
                        "engine's 16; on a TPU 128); with --refit, the launch.PAGED_OVERRIDES of its failed classes")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if args.tpu and (args.sweep or args.refit):
        p.error("--tpu reports the matrix: --sweep and --refit derive the GPU launch table")
    if args.page and args.sweep:
        p.error("--page reads the configurations through a block table: not with --sweep (--refit re-fits them)")
    if args.tpu and not tpu_deviceless.libtpu_available():
        print(f"kernel_report.py: {tpu_report.no_libtpu_message()}", file=sys.stderr)
        return 2
    if not args.tpu and not deviceless.triton_available():
        print("kernel_report.py needs the pip `triton` wheel: pip install -e '.[test]'", file=sys.stderr)
        return 2
    targets = [deviceless.TARGETS[t] for t in args.targets]
    cfgs = [c for c in configs.MATRIX if args.only is None or any(s in c.name for s in args.only)]
    if args.page:
        cfgs = [configs.paged(c, args.page) for c in cfgs if not c.page]
    elif args.tpu:  # MATRIX's pools have the GPU engine's 16-token pages; a TPU's are --page 128
        cfgs = [c for c in cfgs if not c.page]
    if args.ci_subset:
        cfgs = [c for c in cfgs if c.name in (configs.TPU_CI_SUBSET if args.tpu else configs.CI_SUBSET)]
    i, n = map(int, args.shard.split("/")) if args.shard else (0, 1)
    versions = tpu_report.versions() if args.tpu else deviceless.toolchain_versions()
    start = time.perf_counter()
    if args.tpu:
        rows = tpu_report.report(cfgs[i::n], args.tpu)
        result = dict(versions=versions, rows=rows)
        failed = tpu_report.failed(rows)
        print(tpu_report.summary(rows))
        if args.markdown:
            write_text(args.markdown, tpu_report.markdown(rows, versions))
    elif args.refit or args.sweep:
        if args.refit:
            try:
                keys = report.failed_keys(args.refit, cfgs)[i::n]
            except ValueError as err:
                p.error(f"--refit {args.refit}: {err}")
            out = report.refit(keys, targets, args.cache, cfgs=cfgs)
        else:
            keys = {c.launch_key() for c in cfgs} - {None}
            families = sorted({report.family(k) for k in keys})[i::n]
            out = report.sweep([k for k in keys if report.family(k) in families], targets, args.cache)
        name = ("PAGED_OVERRIDES" if args.page else "OVERRIDES") if args.refit else "TABLE"
        print(report.table_source(out["table"], name))
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
