"""Decode-attention time of a cache scheme against the bytes it must read (`scripts/bench_attention.py`).

One decode step of one layer over a loop group of `LOOPS` loops (Ouro's 4 loops; one of Huginn's
groups of 4 steps): every loop's queries (one token, all heads) attend to that loop's stored past
through the format's own `attend` (its fast path: the fused Pallas kernel on a GPU for the `LoopQuant`
family, XLA elsewhere). The cache is a one-layer model cache of the preset's head shape filled
through the format's `write` (`rq_jax.perf.fill.filled_row`). Bytes read per step follow the
format's `read_bits_per_element` (a residual loop re-reads its anchor). On a GPU the dense slot is
also timed through the dense Pallas kernel and JAX's own `decode_attention`, the outside peer.

`with_impl` gives a format on one implementation of the decode-attention op (`rq_jax.cache.attention`),
`fallbacks` collects the op's fallback warnings (a kernel that does not cover a slot), and
`read_bandwidth` / `copy_bandwidth` measure the device's memory bandwidth in the same run;
`scripts/bench_decode.py` shares `bytes_read` and `read_bandwidth`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time

import cpu_kernels
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention as jda
from pallas_kernels import dense_decode_attention

from rq_jax.cache import attention, base
from rq_jax.cache.calib import default_calib
from rq_jax.cache.kv import cache_bytes, init_cache
from rq_jax.config import ModelConfig, preset
from rq_jax.perf.fill import filled_row, repeat_rows

LOOPS = 4


def attention_config(name: str, context: int) -> ModelConfig:
    """Preset `name`'s head shape as one looped layer of `LOOPS` loops, no plain layers, positions for
    `context` tokens."""
    c = preset(name)
    return c.replace(num_layers=1, num_loops=LOOPS, num_prelude=0, num_coda=0,
                     max_position_embeddings=max(c.max_position_embeddings, context + 1))


def filled_cache(config: ModelConfig, fmt: base.CacheFormat, batch: int, context: int, seed: int = 0):
    """(a cache of `batch` rows holding `context` random tokens written by `fmt`, its calibration). The cache
    is held as bits (`KVCache.as_bits`), as the Sampler, the eval loops and the engine hold theirs."""
    calib = default_calib(jax.eval_shape(lambda: init_cache(config, 1, 1, fmt)))
    return repeat_rows(filled_row(config, fmt, calib, context, seed=seed), batch, context).as_bits(), calib


def bytes_read(fmt: base.CacheFormat, config: ModelConfig, batch: int, context: int) -> int:
    """Cache bytes one decode step's attention reads from `context` stored tokens per row (K and V of every
    slot): `rq_jax.cache.kv.cache_bytes`'s `read` of a cache of `batch` rows of `context` positions, the
    arrays' bytes with a residual loop re-reading its anchor, as `rq_jax.memory.byte_limits` counts them.
    For `attention_config` (one layer of `LOOPS` loops): that layer's bytes."""
    return cache_bytes(config, fmt, context, batch=batch).read


def takes_impl(fmt: base.CacheFormat) -> bool:
    """Whether the format has an `attend_impl` policy field (the others' attention is XLA's only)."""
    return any(f.name == "attend_impl" for f in dataclasses.fields(fmt))


def with_impl(fmt: base.CacheFormat, impl: str) -> base.CacheFormat:
    """`fmt` with attend_impl = `impl` ("auto", "xla", "native", "pallas"), and write_impl too where it has one
    (a benchmark row's impl is its whole path); a format without the fields as it is."""
    if not takes_impl(fmt):
        return fmt
    writes = any(f.name == "write_impl" for f in dataclasses.fields(fmt))
    return dataclasses.replace(fmt, attend_impl=impl, **({"write_impl": impl} if writes else {}))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


@contextlib.contextmanager
def fallbacks():
    """Collect (a list, filled inside the block) the decode-attention op's fallback warnings logged while
    tracing inside it: "... attend_impl='native' does not cover this slot (why); using xla". An explicit
    implementation logs at every trace, so a program traced inside says whether its kernel ran. The
    records still propagate to the loggers above (Python's last-resort stderr handler, though, only
    prints when no handler at all takes them: print the list)."""
    handler = _Collect()
    attention.log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        attention.log.removeHandler(handler)


def step_fn(fmt: base.CacheFormat):
    """jit(q [L, B, 1, H, D] float32, cache, calib, inner) → a scalar depending on every loop's partial,
    `inner` steps in one executable (each depending on the one before, so none is hoisted or dropped)."""

    def one(q, cache, calib, loop):
        seg, index, r = cache.locate("looped", loop, 0)
        part = None if calib.looped is None else calib.looped[seg]
        return fmt.attend(cache.values("looped")[seg], index, r, q, cache.lengths, part)

    def step(q, cache, calib, inner):
        def body(i, carry):
            outs = [one(q[r] + carry * 1e-30, cache, calib, r) for r in range(LOOPS)]
            return carry + sum(jnp.sum(o.acc) + jnp.sum(o.l) for o in outs) * 1e-30

        return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

    return jax.jit(step, static_argnames="inner")


def dense_kernel_fn(impl: str):
    """On the dense bf16 slot stack [M, B, K, S, D]: jit(q [L, B, K, R, D], k, v, lengths, inner) through
    the dense Pallas kernel ("pallas") or JAX's own decode attention ("jax-peer")."""
    def one(q, k, v, lengths, slot):
        if impl == "pallas":
            return dense_decode_attention(q, k, v, lengths, slot)
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


def usable_impls(impls: list[str]) -> tuple[list[str], str]:
    """(`impls` less "native" where the native CPU kernels cannot run, a line saying why; "" when none is
    dropped): the `--impls` of the benchmark scripts."""
    if "native" not in impls:
        return list(impls), ""
    why = ""
    if jax.default_backend() != "cpu":
        why = f"the native kernels run on a CPU, this backend is {jax.default_backend()}"
    elif not cpu_kernels.available():
        why = cpu_kernels.unavailable_reason()
    if not why:
        return list(impls), ""
    return [i for i in impls if i != "native"], f"native is unavailable ({why}): its rows are dropped"


def describe_impls(impls: list[str]) -> str:
    """The impls in words for a table's header, naming the native kernels' instruction set where run."""
    if "native" not in impls:
        return ", ".join(impls)
    return ", ".join(f"native ({cpu_kernels.isa()} kernels)" if i == "native" else i for i in impls)


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


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Device read bandwidth in bytes/s: `nbytes` of float32 (a buffer written beforehand) summed by
    `jax.jit(jnp.sum)`, the median of `repeats` calls after a warm-up. What XLA's own reduction reaches
    on this machine, not a hardware peak: a kernel reading faster than XLA's reduction exceeds it."""
    x = jax.block_until_ready(jnp.full(nbytes // 4, 1.0, jnp.float32))
    return (nbytes // 4) * 4 / timed(jax.jit(jnp.sum), (x,), repeats)
