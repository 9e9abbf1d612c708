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

Columns: `impl` (the implementation the row asked for; "native→xla" when the op fell back to XLA for
this slot, the reason printed above the table and kept in the JSON's `fallback`), time (median of
--repeats; each timed call runs the step --inner times inside one executable to hide dispatch), the
cache bytes the step reads (`read_bits_per_element`: codes, metadata and α, a residual loop re-reading
its anchor), achieved GB/s on those bytes, that as a fraction of the copy bandwidth (`x + 1` over
--copy-mb MiB: read + write bytes per second) and of the read bandwidth (`jit(jnp.sum)` over --read-mb
MiB: read bytes per second, what XLA's own reduction reaches here; "% read BW" near 100% means the
step reads its bytes as fast as XLA reads an array, and a kernel reading faster than XLA's reduction
passes 100%), both bandwidths measured in the same run and printed in the header;
the speed ratio to the dense row of the same impl measured in the same run (the dense kernels on a GPU:
to the first impl's dense row), and the byte-limit ratio (dense bytes / format bytes: the most a format
can gain over a dense kernel at the same bandwidth; Ouro's residual [2,2,2,4]: 64 / 25.875 = 2.47x).
So "x vs dense" of a native row is the native format over native dense, never over XLA dense; compare
impls on "ms/step" of the same format. On a GPU the dense slot is also timed through the dense Pallas
kernel and JAX's `decode_attention` (the outside peer; impls "pallas", "jax-peer").
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax

from rq_jax import cli
from rq_jax.cache.schemes import BENCH_ATTENTION, pick
from rq_jax.config import PRESETS
from rq_jax.perf import attention as pa


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
    device = jax.devices()[0]
    copy_bw = pa.copy_bandwidth(args.copy_mb << 20, args.repeats)
    read_bw = pa.read_bandwidth(args.read_mb << 20, args.repeats)
    head = (f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; copy bandwidth "
            f"{copy_bw / 1e9:.1f} GB/s (read+write); read bandwidth {read_bw / 1e9:.1f} GB/s (jit(jnp.sum) of "
            f"{args.read_mb} MiB); {pa.LOOPS} loops per step, one layer; queries float32, 1 token; impls "
            + pa.describe_impls(impls))
    print(head)
    cols = ("model", "batch", "context", "format", "impl", "stored", "ms/step", "MB read", "GB/s", "% copy BW",
            "% read BW", "x vs dense", "byte limit x")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print(lines[0])
    rows = []
    key = jax.random.key(0)
    for model in args.models:
        for context in args.context:
            config = pa.attention_config(model, context)
            dense_bytes = pa.bytes_read(pick(["dense bf16"])[0].fmt, config, 1, context)
            for batch in args.batch:
                q = jax.random.normal(key, (pa.LOOPS, batch, 1, config.num_heads, config.head_dim))
                block = []  # this (model, context, batch)'s rows: their ratios pair the dense row of their impl
                for scheme in schemes:
                    cache, calib = pa.filled_cache(config, scheme.fmt, batch, context)
                    # A format without attend_impl has XLA's attention only: one row ("auto" on a GPU).
                    own = list(dict.fromkeys(i if pa.takes_impl(scheme.fmt) or i == "auto" else "xla"
                                             for i in impls))
                    entries = [(i, pa.step_fn(pa.with_impl(scheme.fmt, i)), (q, cache, calib)) for i in own]
                    if on_gpu and not args.no_peer and scheme.label == "dense bf16":
                        ((slot,),) = cache.values("looped")
                        kq = q.reshape(pa.LOOPS, batch, config.num_kv_heads, -1, config.head_dim)
                        k, v = (x.reshape(-1, *x.shape[2:]) for x in (slot.k, slot.v))
                        entries += [(impl, pa.dense_kernel_fn(impl), (kq, k, v, cache.lengths))
                                    for impl in ("pallas", "jax-peer")]
                    for impl, fn, fargs in entries:
                        try:
                            with pa.fallbacks() as fell:
                                secs = pa.timed(functools.partial(fn, inner=args.inner), fargs,
                                                args.repeats) / args.inner
                        except Exception as err:  # the peer may not cover a shape (head dim 96)
                            print(f"  {model} {scheme.label} {impl}: failed ({type(err).__name__}: {str(err)[:120]})")
                            continue
                        for message in fell:
                            print(f"  {model} {scheme.label} {impl}: {message}")
                        nbytes = pa.bytes_read(scheme.fmt, config, batch, context)
                        block.append(dict(model=model, batch=batch, context=context, format=scheme.label, impl=impl,
                                          fallback=fell or None, stored=scheme.stored, ms=1e3 * secs, bytes=nbytes,
                                          gbps=nbytes / secs / 1e9, copy_fraction=nbytes / secs / copy_bw,
                                          read_fraction=nbytes / secs / read_bw,
                                          byte_limit=dense_bytes / pa.bytes_read(scheme.fmt, config, 1, context)))
                    del cache
                dense_ms = {r["impl"]: r["ms"] for r in block if r["format"] == "dense bf16"}
                for r in block:  # the dense kernels (GPU) are measured against the first impl's dense row
                    pair = impls[0] if r["impl"] in ("pallas", "jax-peer") else r["impl"]
                    r["dense_impl"] = pair if pair in dense_ms else None
                    r["speedup"] = dense_ms[pair] / r["ms"] if pair in dense_ms else None
                    shown = r["impl"] + ("→xla" if r["fallback"] else "")
                    cells = (model, batch, context, r["format"], shown, r["stored"], f"{r['ms']:.3f}",
                             f"{r['bytes'] / 2**20:.1f}", f"{r['gbps']:.1f}", f"{100 * r['copy_fraction']:.0f}%",
                             f"{100 * r['read_fraction']:.0f}%",
                             "-" if r["speedup"] is None else f"{r['speedup']:.2f}", f"{r['byte_limit']:.2f}")
                    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
                    print(lines[-1], flush=True)
                rows += block
    if args.markdown:
        Path(args.markdown).write_text(head + "\n\n" + "\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(header=head, device=device.device_kind, platform=device.platform,
                                                   jax=jax.__version__, copy_bandwidth=copy_bw,
                                                   read_bandwidth=read_bw, impls=impls, args=vars(args),
                                                   rows=rows), indent=2))


if __name__ == "__main__":
    main()
