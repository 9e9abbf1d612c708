"""The model-level KV cache (a typed pytree) and the per-call context that reads and writes it.

A `KVCache` holds one format state for the looped layers ([loops, layers] slots) and, for Huginn,
one for the plain prelude/coda layers ([1, prelude + coda] slots), plus the number of tokens stored
per row. The formats are static fields, so a jitted function retraces only when they change.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from rq_jax.cache import base
from rq_jax.config import ModelConfig

Group = Literal["looped", "plain"]


@struct.dataclass
class KVCache:
    """Stored K/V of every (loop, layer) slot; `lengths[b]` tokens are valid in row b."""

    looped: Any
    plain: Any
    lengths: Int[Array, "b"]
    fmt: base.CacheFormat = struct.field(pytree_node=False)
    plain_fmt: base.CacheFormat = struct.field(pytree_node=False)
    num_loops: int = struct.field(pytree_node=False)
    max_len: int = struct.field(pytree_node=False)


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of the stored K/V and metadata, from the arrays themselves (the `lengths` counter excluded)."""
    plain = cache.plain_fmt.nbytes(cache.plain) if cache.plain is not None else 0
    return cache.fmt.nbytes(cache.looped) + plain


class CacheCalib(NamedTuple):
    """Static calibration state for the looped slots and for the plain (prelude/coda) slots.

    Either part may be None: the format then uses its `default_calib` (e.g. Hadamard rotations).
    """

    looped: Any = None
    plain: Any = None


def calibrate(dense: KVCache, fmt: base.CacheFormat, plain_fmt: base.CacheFormat | None = None) -> CacheCalib:
    """Fit `fmt` (and `plain_fmt`, default `fmt`) on the K/V stored in a dense cache."""
    plain_fmt = plain_fmt or fmt
    plain = None if dense.plain is None else plain_fmt.calibrate(dense.plain.k, dense.plain.v, dense.lengths)
    return CacheCalib(fmt.calibrate(dense.looped.k, dense.looped.v, dense.lengths), plain)


def init_cache(config: ModelConfig, batch: int, max_len: int, fmt: base.CacheFormat | None = None, *,
               num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens, run with `num_loops` loops.

    `fmt` stores the looped layers (default dense bf16); `plain_fmt` Huginn's prelude/coda (default
    `fmt`). Raises ValueError if `max_len` exceeds the model's maximum position.
    """
    from rq_jax.cache.dense import Dense

    fmt = fmt or Dense()
    plain_fmt = plain_fmt or fmt
    num_loops = num_loops or config.num_loops
    if max_len > config.max_position_embeddings:
        raise ValueError(f"cache max_len {max_len} exceeds the model's max positions "
                         f"{config.max_position_embeddings}")
    if batch <= 0 or max_len <= 0 or num_loops <= 0:
        raise ValueError(f"batch ({batch}), max_len ({max_len}) and num_loops ({num_loops}) must be positive")
    dims = (batch, max_len, config.num_kv_heads, config.head_dim)
    looped = fmt.init(num_loops, config.num_layers, *dims)
    plain = plain_fmt.init(1, config.num_plain_layers, *dims) if config.num_plain_layers else None
    return KVCache(looped, plain, jnp.zeros((batch,), jnp.int32), fmt, plain_fmt, num_loops, max_len)


class CallContext:
    """Bookkeeping of one forward call, used while tracing: read the past, keep K/V in flight, write once.

    `attend` merges the stored past (if any) with this call's own full-precision K/V under a causal
    mask restricted to t < num_new[b]; `finish` encodes every slot's in-flight K/V into the cache.
    """

    def __init__(self, cache: KVCache | None, num_new: Int[Array, "b"], num_tokens: int,
                 calib: CacheCalib | None = None):
        self.cache, self.num_new, self.calib = cache, num_new, calib or CacheCalib()
        t = jnp.arange(num_tokens)
        self.self_mask = (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] < num_new[:, None, None])
        self.inflight: dict[tuple[Group, int, int], tuple[Array, Array]] = {}

    def positions(self) -> Int[Array, "b t"]:
        """Absolute positions of this call's tokens: stored length of the row plus offset."""
        start = self.cache.lengths if self.cache is not None else jnp.zeros_like(self.num_new)
        return start[:, None] + jnp.arange(self.self_mask.shape[1])[None, :]

    def attend(self, group: Group, loop: int, layer: int, q: Float[Array, "b t h d"],
               k: Float[Array, "b k t d"], v: Float[Array, "b k t d"]) -> Float[Array, "b t h d"]:
        """Attention output for slot (group, loop, layer); records (k, v) as in flight."""
        self.inflight[group, loop, layer] = (k, v)
        out = base.dense_partial(q, k, v, self.self_mask)
        if self.cache is not None:
            fmt, state, calib = ((self.cache.fmt, self.cache.looped, self.calib.looped) if group == "looped"
                                 else (self.cache.plain_fmt, self.cache.plain, self.calib.plain))
            out = base.merge(fmt.attend(state, q, loop, layer, self.cache.lengths, calib), out)
        return base.finalize(out).astype(q.dtype)

    def finish(self) -> KVCache | None:
        """The cache with every slot's in-flight tokens written and lengths advanced."""
        c = self.cache
        if c is None:
            return None
        looped = c.fmt.write(c.looped, *self._stack("looped", c.num_loops), c.lengths, self.num_new,
                             self.calib.looped)
        plain = c.plain
        if plain is not None:
            plain = c.plain_fmt.write(plain, *self._stack("plain", 1), c.lengths, self.num_new, self.calib.plain)
        return c.replace(looped=looped, plain=plain, lengths=c.lengths + self.num_new)

    def _stack(self, group: Group, num_loops: int) -> tuple[Array, Array]:
        layers = sorted({n for g, _, n in self.inflight if g == group})
        missing = [(l, n) for l in range(num_loops) for n in layers if (group, l, n) not in self.inflight]
        if missing:
            raise ValueError(f"the cache holds {num_loops} loops but this call ran fewer: no K/V for "
                             f"(loop, layer) {missing[:3]}...; run as many loops as the cache was built for")
        kv = [[self.inflight[group, l, n] for n in layers] for l in range(num_loops)]
        return tuple(jnp.stack([jnp.stack([pair[i] for pair in row]) for row in kv]) for i in (0, 1))


def dense_equivalent_nbytes(config: ModelConfig, cache: KVCache, dtype: str = "bfloat16") -> int:
    """Bytes a dense cache of `dtype` with the same batch, length and loops would take (nothing allocated)."""
    from rq_jax.cache.dense import Dense

    shapes = jax.eval_shape(lambda: init_cache(config, cache.lengths.shape[0], cache.max_len, Dense(dtype),
                                               num_loops=cache.num_loops))
    leaves = jax.tree_util.tree_leaves((shapes.looped, shapes.plain))
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))
