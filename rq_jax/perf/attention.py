"""Decode-attention time of a cache scheme against the bytes it must read (`scripts/bench_attention.py`).

One decode step of one layer over a loop group of `LOOPS` loops (Ouro's 4 loops; one of Huginn's
groups of 4 steps): every loop's queries (one token, all heads) attend to that loop's stored past
through the format's own `attend` (its fast path: the fused Pallas kernel on a GPU for the `LoopQuant`
family, XLA elsewhere). The cache is a one-layer model cache of the preset's head shape filled
through the format's `write` (`rq_jax.perf.decode.filled_row`). Bytes read per step follow the
format's `read_bits_per_element` (a residual loop re-reads its anchor). On a GPU the dense slot is
also timed through the dense Pallas kernel and JAX's own `decode_attention`, the outside peer.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

from rq_jax.cache import base
from rq_jax.cache.calib import default_calib
from rq_jax.cache.kv import init_cache
from rq_jax.config import ModelConfig, preset
from rq_jax.perf.decode import filled_row, repeat_rows

LOOPS = 4


def attention_config(name: str, context: int) -> ModelConfig:
    """Preset `name`'s head shape as one looped layer of `LOOPS` loops, no plain layers, positions for
    `context` tokens."""
    c = preset(name)
    return c.replace(num_layers=1, num_loops=LOOPS, num_prelude=0, num_coda=0,
                     max_position_embeddings=max(c.max_position_embeddings, context + 1))


def filled_cache(config: ModelConfig, fmt: base.CacheFormat, batch: int, context: int, seed: int = 0):
    """(a cache of `batch` rows holding `context` random tokens written by `fmt`, its calibration)."""
    calib = default_calib(jax.eval_shape(lambda: init_cache(config, 1, 1, fmt)))
    return repeat_rows(filled_row(config, fmt, calib, context, seed), batch, context), calib


def bytes_read(fmt: base.CacheFormat, config: ModelConfig, batch: int, context: int) -> int:
    """Cache bytes one step (every loop, K and V) reads: `read_bits_per_element` × the stored elements."""
    elements = 2 * LOOPS * batch * config.num_kv_heads * context * config.head_dim
    return int(fmt.read_bits_per_element(LOOPS, config.head_dim, context) * elements / 8)


def step_fn(fmt: base.CacheFormat):
    """jit(q [L, B, 1, H, D] float32, cache, calib, inner) → a scalar depending on every loop's partial,
    `inner` steps in one executable (each depending on the one before, so none is hoisted or dropped)."""

    def one(q, cache, calib, loop):
        seg, index, r = cache.locate("looped", loop, 0)
        part = None if calib.looped is None else calib.looped[seg]
        return fmt.attend(cache.looped[seg], index, r, q, cache.lengths, part)

    def step(q, cache, calib, inner):
        def body(i, carry):
            outs = [one(q[r] + carry * 1e-30, cache, calib, r) for r in range(LOOPS)]
            return carry + sum(jnp.sum(o.acc) + jnp.sum(o.l) for o in outs) * 1e-30

        return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

    return jax.jit(step, static_argnames="inner")


def dense_kernel_fn(impl: str):
    """On the dense bf16 slot stack [M, B, K, S, D]: jit(q [L, B, K, R, D], k, v, lengths, inner) through
    the dense Pallas kernel ("pallas") or JAX's own decode attention ("jax-peer")."""
    from pallas_kernels import dense_decode_attention

    def one(q, k, v, lengths, slot):
        if impl == "pallas":
            return dense_decode_attention(q, k, v, lengths, slot)
        from jax.experimental.pallas.ops.gpu import decode_attention as jda

        mqa = functools.partial(jda.mqa, return_residuals=True, normalize_output=False)
        o, (l, m) = jax.vmap(lambda q, k, v: mqa(q, k, v, kv_seq_len=lengths), in_axes=(1, 1, 1),
                             out_axes=1)(q.astype(jnp.bfloat16), k[slot], v[slot])
        return o, m, l

    def step(q, k, v, lengths, inner):
        def body(i, carry):
            outs = [one(q[r] + carry * 1e-30, k, v, lengths, r) for r in range(LOOPS)]
            return carry + sum(jnp.sum(o[0]) + jnp.sum(o[2]) for o in outs) * 1e-30

        return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

    return jax.jit(step, static_argnames="inner")


def timed(fn, args, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn(*args) after one warm-up, each ended by block_until_ready."""
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
    return 2 * nbytes / timed(jax.jit(lambda x: x + 1.0), (x,), repeats)
