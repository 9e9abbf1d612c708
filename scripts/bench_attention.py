"""Decode-attention time per cache format against the bytes it must read; markdown + JSON.

    python scripts/bench_attention.py                       # CPU: a small default grid, a few minutes
    python scripts/bench_attention.py --batch 1 4 --context 1024 4096 16384 32768   # GPU default grid

One decode step of one layer over a loop group of 4 loops at a preset's head shape (`rq_jax.perf.attention`):
every loop's queries attend to that loop's stored past of `context` tokens through the format's own
attention (the fused Pallas kernel on a GPU for uniform/rotated/residual; XLA elsewhere, whose times say
nothing about the kernels). Rows are the scheme catalog's (`rq_jax.cache.schemes.BENCH_ATTENTION`).

Columns: time (median of --repeats; each timed call runs the step --inner times inside one executable to
hide dispatch), the cache bytes the step reads (`read_bits_per_element`: codes, metadata and α, a residual
loop re-reading its anchor), achieved GB/s on those bytes, that as a fraction of the measured device copy
bandwidth, the speed ratio to dense measured in the same run, and the byte-limit ratio (dense bytes /
format bytes: the most a format can gain over a dense kernel at the same bandwidth; Ouro's residual
[2,2,2,4]: 64 / 25.875 = 2.47x). On a GPU the dense slot is also timed through the dense Pallas kernel and
JAX's `decode_attention` (the outside peer).
"""

from __future__ import annotations

import functools
import json
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
    p.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 4] if on_gpu else [1], help="rows")
    p.add_argument("--context", type=cli.positive_int, nargs="+",
                   default=[1024, 4096, 16384, 32768] if on_gpu else [1024, 4096], help="tokens cached")
    p.add_argument("--repeats", type=cli.positive_int, default=10 if on_gpu else 3, help="timed calls (median)")
    p.add_argument("--inner", type=cli.positive_int, default=20 if on_gpu else 1, help="steps per timed call")
    p.add_argument("--no-peer", action="store_true", help="skip the dense kernel rows on a GPU")
    p.add_argument("--copy-mb", type=cli.positive_int, default=1024 if on_gpu else 128,
                   help="MiB copied to measure the copy bandwidth")
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
    device = jax.devices()[0]
    copy_bw = pa.copy_bandwidth(args.copy_mb << 20, args.repeats)
    head = (f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; copy bandwidth "
            f"{copy_bw / 1e9:.1f} GB/s (read+write); {pa.LOOPS} loops per step, one layer; queries float32, 1 token")
    print(head)
    cols = ("model", "batch", "context", "format", "impl", "stored", "ms/step", "MB read", "GB/s", "% copy BW",
            "x vs dense", "byte limit x")
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
                dense_ms = None
                for scheme in schemes:
                    cache, calib = pa.filled_cache(config, scheme.fmt, batch, context)
                    entries = [("format", pa.step_fn(scheme.fmt), (q, cache, calib))]
                    if on_gpu and not args.no_peer and scheme.label == "dense bf16":
                        ((slot,),) = cache.looped
                        kq = q.reshape(pa.LOOPS, batch, config.num_kv_heads, -1, config.head_dim)
                        k, v = (x.reshape(-1, *x.shape[2:]) for x in (slot.k, slot.v))
                        entries += [(impl, pa.dense_kernel_fn(impl), (kq, k, v, cache.lengths))
                                    for impl in ("pallas", "jax-peer")]
                    for impl, fn, fargs in entries:
                        try:
                            secs = pa.timed(functools.partial(fn, inner=args.inner), fargs, args.repeats) / args.inner
                        except Exception as err:  # the peer may not cover a shape (head dim 96)
                            print(f"  {model} {scheme.label} {impl}: failed ({type(err).__name__}: {str(err)[:120]})")
                            continue
                        nbytes = pa.bytes_read(scheme.fmt, config, batch, context)
                        if scheme.label == "dense bf16" and impl == "format":
                            dense_ms = 1e3 * secs
                        row = dict(model=model, batch=batch, context=context, format=scheme.label, impl=impl,
                                   stored=scheme.stored, ms=1e3 * secs, bytes=nbytes, gbps=nbytes / secs / 1e9,
                                   copy_fraction=nbytes / secs / copy_bw,
                                   speedup=None if dense_ms is None else dense_ms / (1e3 * secs),
                                   byte_limit=dense_bytes / pa.bytes_read(scheme.fmt, config, 1, context))
                        rows.append(row)
                        cells = (model, batch, context, scheme.label, impl, row["stored"], f"{row['ms']:.3f}",
                                 f"{nbytes / 2**20:.1f}", f"{row['gbps']:.1f}", f"{100 * row['copy_fraction']:.0f}%",
                                 "-" if row["speedup"] is None else f"{row['speedup']:.2f}",
                                 f"{row['byte_limit']:.2f}")
                        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
                        print(lines[-1], flush=True)
                    del cache
    if args.markdown:
        Path(args.markdown).write_text(head + "\n\n" + "\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(header=head, device=device.device_kind, platform=device.platform,
                                                   jax=jax.__version__, copy_bandwidth=copy_bw, args=vars(args),
                                                   rows=rows), indent=2))


if __name__ == "__main__":
    main()
