"""Decode-attention time per cache format against the bytes it must read; markdown + JSON.

    python scripts/bench_attention.py                       # CPU: a small default grid, a few minutes
    python scripts/bench_attention.py --batch 1 4 --context 1024 4096 16384 32768   # GPU default grid

One decode step of one layer over a loop group of 4 loops (Ouro's 4 loops; one of Huginn's groups of
4 steps): every loop's queries (one token, all heads) attend to that loop's stored past of `context`
tokens, every row full. Formats:

    dense bf16          bf16 K/V per loop
    uniform INT2        INT2 g32 codes + FP8 scale/offset per loop (identity rotation)
    rotated INT2        the same stream; queries rotated in and the output rotated back
    residual [2,2,2,4]  loops 0-2 read their INT2 g32 residual + α and the INT4 g32 anchor, loop 3 the
                        anchor alone (last-loop reference, FP8 metadata, bf16 α); rotated like `rotated`

Columns: time (median of --repeats; on a GPU each timed call runs the step --inner times inside one
executable to hide dispatch), the cache bytes the step must read (codes, metadata, α of the valid
tokens: the byte budget), achieved GB/s on those bytes, that as a fraction of the measured device copy
bandwidth (read + write of a large buffer), the speed ratio to dense measured in the same run, and the
byte-limit ratio (dense bytes / format bytes: the most a format can gain over a dense kernel running
at the same bandwidth; Ouro's residual: 64 / 25.875 = 2.47x).

Implementations: on a GPU the Pallas kernels (`pallas_kernels`) plus JAX's own
`jax.experimental.pallas.ops.gpu.decode_attention` as the outside peer for dense; elsewhere the XLA
reference paths (`*_reference`, float32 compute at HIGHEST precision on the stored dtype), whose times
say nothing about the kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import dense_attention as da  # noqa: E402
from pallas_kernels import residual_attention as ra  # noqa: E402

#: Head shapes: (query heads, kv heads, head dim).
MODELS = {"ouro-1.4b": (16, 16, 128), "huginn-0125": (55, 55, 96)}
LOOPS = 4
GROUP = 32
META = jnp.float8_e4m3fn
FORMATS = ("dense bf16", "uniform INT2", "rotated INT2", "residual [2,2,2,4]")
STORED = {"dense bf16": "bf16", "uniform INT2": "u8 codes + fp8 meta", "rotated INT2": "u8 codes + fp8 meta",
          "residual [2,2,2,4]": "u8 codes + fp8 meta + bf16 α"}


# ---- caches ----------------------------------------------------------------------------------------


def _stream(key, lead, dim, bits):
    kc, ks, ko = jax.random.split(key, 3)
    ng = dim // GROUP
    return ra.QuantStream(jax.random.bits(kc, lead + (dim * bits // 8,), jnp.uint8),
                          jax.random.uniform(ks, lead + (ng,), jnp.float32, 0.02, 0.3).astype(META),
                          (0.5 * jax.random.normal(ko, lead + (ng,), jnp.float32)).astype(META))


@functools.partial(jax.jit, static_argnames=("fmt", "batch", "kv_heads", "dim", "context"))
def make_cache(key, *, fmt: str, batch: int, kv_heads: int, dim: int, context: int):
    """Per loop: what attention to that loop reads, stacked over M = 1 slot (random, made on device)."""
    lead = (1, batch, kv_heads, context)
    keys = jax.random.split(key, 4 * LOOPS)
    if fmt == "dense bf16":
        return [tuple(jax.random.normal(keys[2 * r + i], lead + (dim,), jnp.bfloat16) for i in range(2))
                for r in range(LOOPS)]
    if fmt in ("uniform INT2", "rotated INT2"):
        return [dict(keys=(_stream(keys[2 * r], lead, dim, 2),), values=(_stream(keys[2 * r + 1], lead, dim, 2),),
                     k_alpha=(), v_alpha=()) for r in range(LOOPS)]
    anchor_k, anchor_v = _stream(keys[0], lead, dim, 4), _stream(keys[1], lead, dim, 4)
    out = []
    for r in range(LOOPS - 1):
        k1, k2, k3, k4 = keys[4 + 4 * r: 8 + 4 * r]
        alpha = lambda k: jax.random.uniform(k, lead, jnp.float32, 0.3, 1.2).astype(jnp.bfloat16)  # noqa: E731
        out.append(dict(keys=(_stream(k1, lead, dim, 2), anchor_k), values=(_stream(k2, lead, dim, 2), anchor_v),
                        k_alpha=(alpha(k3),), v_alpha=(alpha(k4),)))
    out.append(dict(keys=(anchor_k,), values=(anchor_v,), k_alpha=(), v_alpha=()))
    return out


def bytes_read(fmt: str, tokens: int, kv_heads: int, dim: int) -> int:
    """Cache bytes one step (all loops) must read for `tokens` valid tokens per kv head, K and V."""
    meta = 2 * (dim // GROUP) * jnp.dtype(META).itemsize
    int2, int4 = dim // 4 + meta, dim // 2 + meta
    per_token = {"dense bf16": LOOPS * 2 * dim,
                 "uniform INT2": LOOPS * int2,
                 "rotated INT2": LOOPS * int2,
                 "residual [2,2,2,4]": (LOOPS - 1) * (int2 + 2 + int4) + int4}[fmt]
    return 2 * per_token * tokens * kv_heads  # K and V


# ---- the timed step --------------------------------------------------------------------------------


def step_fn(fmt: str, impl: str, plan: dict):
    """f(q [L, B, K, R, D] f32, rot [K, D, D], cache, lengths) -> per-loop partials, jitted."""

    def one(q, rot, cache_r, lengths):
        if fmt == "dense bf16":
            k, v = cache_r
            if impl == "jax-peer":
                return _jax_peer(q.astype(jnp.bfloat16), k[0], v[0], lengths)
            f = da.dense_decode_attention if impl == "pallas" else da.dense_decode_attention_reference
            return f(q, k, v, lengths, 0, **plan)
        rotate = fmt != "uniform INT2"
        if rotate:
            q = jnp.einsum("bkrd,ked->bkre", q, rot)
        f = ra.residual_decode_attention if impl == "pallas" else ra.residual_decode_attention_reference
        acc, m, l = f(q, cache_r["keys"], cache_r["values"], cache_r["k_alpha"], cache_r["v_alpha"], None,
                      lengths, 0, **plan)
        if rotate:
            acc = jnp.einsum("bkre,ked->bkrd", acc, rot)
        return acc, m, l

    def step(q, rot, cache, lengths, inner):
        def body(i, carry):
            # Each call depends on the previous one and every output is used, so XLA can neither hoist
            # the loop body nor drop part of it.
            outs = [one(q[r] + carry * 1e-30, rot, cache[r], lengths) for r in range(LOOPS)]
            return carry + sum(jnp.sum(o[0]) + jnp.sum(o[2]) for o in outs) * 1e-30
        return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

    return jax.jit(step, static_argnames="inner")


def _jax_peer(q, k, v, lengths):
    """JAX's Pallas GPU decode attention (mqa per kv head), returning its residuals like ours."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jda

    mqa = functools.partial(jda.mqa, return_residuals=True, normalize_output=False)
    o, (l, m) = jax.vmap(lambda q, k, v: mqa(q, k, v, kv_seq_len=lengths), in_axes=(1, 1, 1), out_axes=1)(q, k, v)
    return o, m, l


def timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Device copy bandwidth in bytes/s: read + write of an `nbytes` float32 buffer."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    return 2 * nbytes / timed(f, (x,), repeats)


# ---- main --------------------------------------------------------------------------------------------


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4] if on_gpu else [1])
    p.add_argument("--context", type=int, nargs="+",
                   default=[1024, 4096, 16384, 32768] if on_gpu else [1024, 4096])
    p.add_argument("--repeats", type=int, default=10 if on_gpu else 3)
    p.add_argument("--inner", type=int, default=20 if on_gpu else 1, help="steps per timed call")
    p.add_argument("--impl", choices=("auto", "pallas", "xla"), default="auto",
                   help="auto: pallas on GPU, the XLA references elsewhere")
    p.add_argument("--block-s", type=int, help="override the kernels' tokens per tile")
    p.add_argument("--num-splits", type=int, help="override the kernels' split count")
    p.add_argument("--no-peer", action="store_true", help="skip JAX's decode_attention on GPU")
    p.add_argument("--copy-mb", type=int, default=1024 if on_gpu else 128)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args(argv)
    impl = args.impl if args.impl != "auto" else ("pallas" if on_gpu else "xla")
    plan = {k: v for k, v in (("block_s", args.block_s), ("num_splits", args.num_splits)) if v}
    plan_dense = plan if impl == "pallas" else {}
    device = jax.devices()[0]
    copy_bw = copy_bandwidth(args.copy_mb << 20, args.repeats)
    compute = "kernels: f32 softmax/acc, bf16x2 dots" if impl == "pallas" else "XLA reference: f32 compute, HIGHEST"
    head = (f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; impl: {impl} ({compute}); "
            f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read+write); {LOOPS} loops per step, one layer; "
            f"queries float32, 1 token")
    print(head)
    cols = ("model", "batch", "context", "format", "impl", "stored dtype", "ms/step", "MB read", "GB/s",
            "% copy BW", "x vs dense", "byte limit x")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print(lines[0])
    rows = []
    key = jax.random.key(0)
    for model in args.models:
        heads, kv_heads, dim = MODELS[model]
        rows_per_kv = heads // kv_heads
        rot = jnp.broadcast_to(jnp.linalg.qr(jax.random.normal(key, (dim, dim)))[0], (kv_heads, dim, dim))
        for batch in args.batch:
            for context in args.context:
                q = jax.random.normal(key, (LOOPS, batch, kv_heads, rows_per_kv, dim), jnp.float32)
                lengths = jnp.full((batch,), context, jnp.int32)
                dense_ms = None
                entries = [(fmt, impl) for fmt in args.formats]
                if impl == "pallas" and on_gpu and not args.no_peer and "dense bf16" in args.formats:
                    entries.insert(1, ("dense bf16", "jax-peer"))
                for fmt, which in entries:
                    cache = make_cache(jax.random.fold_in(key, FORMATS.index(fmt)), fmt=fmt, batch=batch,
                                       kv_heads=kv_heads, dim=dim, context=context)
                    fn = step_fn(fmt, which, plan_dense if fmt == "dense bf16" else (plan if impl == "pallas" else {}))
                    try:
                        secs = timed(functools.partial(fn, inner=args.inner), (q, rot, cache, lengths),
                                     args.repeats) / args.inner
                    except Exception as err:  # the peer may not cover a shape (head dim 96)
                        print(f"  {model} {fmt} {which}: failed ({type(err).__name__}: {str(err)[:120]})")
                        continue
                    del cache
                    nbytes = bytes_read(fmt, context * batch, kv_heads, dim)
                    if fmt == "dense bf16" and which != "jax-peer":
                        dense_ms = 1e3 * secs
                    row = dict(model=model, batch=batch, context=context, format=fmt, impl=which,
                               stored_dtype=STORED[fmt],
                               ms=1e3 * secs, bytes=nbytes, gbps=nbytes / secs / 1e9,
                               copy_fraction=nbytes / secs / copy_bw,
                               speedup=None if dense_ms is None else dense_ms / (1e3 * secs),
                               byte_limit=bytes_read("dense bf16", 1, 1, dim) / bytes_read(fmt, 1, 1, dim))
                    rows.append(row)
                    cells = (model, batch, context, fmt, which, row["stored_dtype"], f"{row['ms']:.3f}",
                             f"{nbytes / 2**20:.1f}", f"{row['gbps']:.1f}", f"{100 * row['copy_fraction']:.0f}%",
                             "-" if row["speedup"] is None else f"{row['speedup']:.2f}", f"{row['byte_limit']:.2f}")
                    line = "| " + " | ".join(str(c) for c in cells) + " |"
                    lines.append(line)
                    print(line, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(head + "\n\n" + "\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(header=head, device=device.device_kind, platform=device.platform,
                                                   jax=jax.__version__, impl=impl, copy_bandwidth=copy_bw,
                                                   args=vars(args), rows=rows), indent=2))


if __name__ == "__main__":
    main()
