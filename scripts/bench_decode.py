"""Decode-step latency and cache bytes per cache format; prints a table and writes JSON.

    python scripts/bench_decode.py --context 2048 --dtype float32

A randomly initialised looped model (the shape is set by the flags) decodes one token against a cache
already holding `--context` tokens of random K/V, written through each format's own `write`. The
jitted step is timed with `block_until_ready`; medians over `--repeats` runs after one warm-up.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rq_jax.cache import cache_nbytes, default_calib, get_format, init_cache
from rq_jax.cache.base import split_loops
from rq_jax.config import ModelConfig
from rq_jax.models import init_model

FORMATS = {
    "dense bf16": ("dense", {}),
    "uniform INT2": ("uniform", {}),
    "rotated INT2": ("rotated", {}),
    "kivi INT2": ("kivi", {}),
    "residual [2,2,2,4]": ("residual", {}),
}


def filled_cache(config, fmt, batch, context, loops, seed):
    """A cache of `context + 1` positions whose first `context` hold random K/V written by `fmt`, and
    the formats' default calibration."""
    cache = init_cache(config, batch, context + 1, fmt, num_loops=loops)
    rng = np.random.default_rng(seed)
    shape = (loops, config.num_layers, batch, config.num_kv_heads, context, config.head_dim)
    shared = rng.normal(size=shape[1:]).astype(np.float32)
    k = jnp.asarray(shared + 0.3 * rng.normal(size=shape).astype(np.float32))
    v = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    zeros, full = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), context, jnp.int32)
    calib = default_calib(cache)
    write = jax.jit(lambda s, k, v, c: fmt.write(s, k, v, zeros, full, c))
    segs = cache.schedule("looped")[1]
    looped = tuple(write(state, split_loops(k, seg), split_loops(v, seg), c)
                   for state, seg, c in zip(cache.looped, segs, calib.looped or (None,) * len(segs)))
    return cache.replace(looped=looped, lengths=full), calib


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--loops", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    hidden = args.heads * args.head_dim
    config = ModelConfig(family="ouro", vocab_size=512, hidden_size=hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.head_dim,
                         intermediate_size=2 * hidden, num_loops=args.loops,
                         max_position_embeddings=args.context + 1, rope_theta=1e6)
    model = init_model(config, dtype=jnp.dtype(args.dtype))
    step = nnx.jit(lambda m, tok, cache, calib: m(tok, cache, last_only=True, calib=calib).logits)
    tok = jnp.zeros((args.batch, 1), jnp.int32)
    rows = []
    print(f"{args.layers} layers x {args.loops} loops, {args.heads} heads x {args.head_dim}, context {args.context}, "
          f"batch {args.batch}, {args.dtype} compute, {jax.devices()[0].platform}")
    print(f"{'format':22s} {'ms/step':>9s} {'vs dense':>9s} {'cache bytes':>13s} {'vs dense':>9s}")
    for label, (name, policy) in FORMATS.items():
        fmt = get_format(name, **policy)
        cache, calib = filled_cache(config, fmt, args.batch, args.context, args.loops, seed=0)
        jax.block_until_ready(step(model, tok, cache, calib))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(model, tok, cache, calib))
            times.append(time.perf_counter() - start)
        row = dict(format=label, ms=1e3 * statistics.median(times), nbytes=cache_nbytes(cache))
        rows.append(row)
        base = rows[0]
        print(f"{label:22s} {row['ms']:9.2f} {row['ms'] / base['ms']:9.2f} {row['nbytes']:13,d} "
              f"{row['nbytes'] / base['nbytes']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
