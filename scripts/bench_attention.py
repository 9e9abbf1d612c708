"""Decode-attention time per cache format against the bytes it must read; markdown + JSON.

    python scripts/bench_attention.py                       # CPU: a small default grid, a few minutes
    python scripts/bench_attention.py --impls native --context 4096 --batch 8    # the native kernels only
    python scripts/bench_attention.py --batch 1 4 --context 1024 4096 16384 32768   # GPU default grid

One decode step of one layer over a loop group of 4 loops at a preset's head shape (`rq_jax.perf.attention`):
every loop's queries attend to that loop's stored past of `context` tokens through the format's own
attention. Rows are the scheme catalog's (`rq_jax.cache.schemes.BENCH_ATTENTION`), each timed once per
`--impls` entry with the format's `attend_impl` set to it (`rq_jax.cache.attention`): on a CPU by default
"xla" (the jnp attention) and "native" (the C++ kernels of `cpu_kernels`, through the XLA FFI); on a GPU
the formats' own "auto" (the fused Pallas kernel for dense and the uniform/rotated/residual family).
Where the native kernels cannot run here one line says why and their rows are dropped; a format without
an `attend_impl` (KIVI, residual_vq) has XLA's attention only and gets one "xla" row.

The columns and their ratios: `rq_jax.perf.attention_report`.
"""

from __future__ import annotations

import json
import sys

import jax

from rq_jax import cli, report
from rq_jax.cache.schemes import BENCH_ATTENTION, pick
from rq_jax.config import PRESETS
from rq_jax.perf import attention as pa
from rq_jax.perf import attention_report


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=["huginn-0125", "ouro-1.4b"],
                   help="presets whose head shape the layer takes")
    p.add_argument("--formats", nargs="+", default=list(BENCH_ATTENTION), help="scheme labels of the catalog")
    p.add_argument("--impls", nargs="+", choices=("xla", "native"), default=["auto"] if on_gpu else ["xla", "native"],
                   metavar="IMPL", help="attend_impl of every format row, one row per impl (xla, native; on a GPU "
                                        "the default is the formats' own 'auto')")
    p.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 4] if on_gpu else [1], help="rows")
    p.add_argument("--context", type=cli.positive_int, nargs="+",
                   default=[1024, 4096, 16384, 32768] if on_gpu else [1024, 4096], help="tokens cached")
    p.add_argument("--repeats", type=cli.positive_int, default=10 if on_gpu else 3, help="timed calls (median)")
    p.add_argument("--inner", type=cli.positive_int, default=20 if on_gpu else 1, help="steps per timed call")
    p.add_argument("--no-peer", action="store_true", help="skip the dense kernel rows on a GPU")
    p.add_argument("--copy-mb", type=cli.positive_int, default=1024 if on_gpu else 128,
                   help="MiB copied to measure the copy bandwidth")
    p.add_argument("--read-mb", type=cli.positive_int, default=1024, help="MiB summed to measure the read bandwidth")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args(argv)
    try:
        schemes = pick(args.formats)
    except ValueError as err:
        p.error(f"argument --formats: {err}")
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path:
            cli.output_file(p, option, path)
    cli.start(args)
    impls, dropped = pa.usable_impls(list(dict.fromkeys(args.impls)))
    if dropped:
        print(dropped)
    if not impls:
        sys.exit(f"{dropped}; no --impls left to run")
    result = attention_report.run(args, schemes, impls)
    if args.markdown:
        report.write_text(args.markdown, attention_report.page(result))
    if args.json:
        report.write_text(args.json, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
