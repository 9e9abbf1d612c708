"""Caches filled with random K/V for the benchmarks: one row written through its formats' own `write`, a
chunk of tokens at a time, then repeated to a batch (`rq_jax.perf.attention`, `rq_jax.perf.decode`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rq_jax.cache.base import split_loops
from rq_jax.cache.kv import init_cache
from rq_jax.config import ModelConfig

#: Elements of random K (or V) generated per write call while filling a cache.
FILL_ELEMENTS = 2**25


@functools.partial(jax.jit, static_argnames="num", donate_argnums=0)
def _write_chunk(cache, calib, key, start, num: int):
    """Write `num` random tokens at position `start` of a one-row cache through its formats' `write`."""
    lengths, num_new = jnp.reshape(start, (1,)), jnp.full((1,), num, jnp.int32)

    def group(name):
        fmt, segs = cache.schedule(name)
        layers, kv_heads, dim = cache.slot_dims(name)
        loops = cache.num_loops if name == "looped" else 1
        ks, kk, kv = jax.random.split(jax.random.fold_in(key, int(name == "plain")), 3)
        shared = jax.random.normal(ks, (layers, 1, kv_heads, num, dim))
        k = shared + 0.3 * jax.random.normal(kk, (loops, layers, 1, kv_heads, num, dim))
        v = jax.random.normal(kv, (loops, layers, 1, kv_heads, num, dim))
        part = calib.looped if name == "looped" else calib.plain
        return tuple(fmt.write(state, split_loops(k, seg), split_loops(v, seg), lengths, num_new,
                               None if part is None else part[i]).state
                     for i, (state, seg) in enumerate(zip(cache.stack(name), segs)))

    plain = None if cache.plain is None else group("plain")
    return cache.replace(looped=group("looped"), plain=plain)


@functools.partial(jax.jit, static_argnames=("batch", "context"))
def repeat_rows(cache, batch: int, context: int):
    """A one-row cache repeated to `batch` rows: state leaves on their batch axis 2, the per-row
    counters ([1]: lengths and the like) on axis 0; lengths set to `context`."""
    looped, plain = jax.tree_util.tree_map(lambda x: jnp.repeat(x, batch, axis=2), (cache.looped, cache.plain))
    rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, batch, axis=0), cache.replace(looped=(), plain=None))
    return rows.replace(looped=looped, plain=plain, lengths=jnp.full((batch,), context, jnp.int32))


def filled_row(config: ModelConfig, fmt, calib, context: int, positions: int | None = None, seed: int = 0):
    """A one-row cache of `positions` (default `context + 1`) positions whose first `context` hold random K/V
    written by `fmt.write` in chunks of tokens (`repeat_rows` makes a batch of it)."""
    row = jax.jit(lambda: init_cache(config, 1, positions or context + 1, fmt))()
    per_token = config.num_loops * config.num_layers * config.num_kv_heads * config.head_dim
    chunk = max(64, min(2048, 2 ** int(math.log2(max(FILL_ELEMENTS // per_token, 1)))))
    key = jax.random.key(seed)
    for start in range(0, context, chunk):
        row = _write_chunk(row, calib, jax.random.fold_in(key, start), jnp.int32(start), min(chunk, context - start))
    return row
