"""The model-level KV cache (a typed pytree), its calibration, and the per-call context that reads it.

A `KVCache` holds the looped layers' K/V (`looped`: one state per segment of the format's loop
groups, see `rq_jax.cache.base`) and, for Huginn, the plain prelude/coda layers' (`plain`: one loop,
layers prelude then coda), plus the number of tokens stored per row. The formats are static fields,
so a jitted function retraces only when they change. `CacheCalib` is the formats' calibration, built
once outside jit and passed alongside the cache.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from rq_jax.cache import base
from rq_jax.config import ModelConfig

Group = Literal["looped", "plain"]
KV = tuple[Array, Array]


@struct.dataclass
class KVCache:
    """Stored K/V of every (loop, layer) slot; `lengths[b]` tokens are valid in row b.

    `overflow[b]` is set when a call gave row b more tokens than fit (possible only inside a compiled
    program, where the call cannot raise): the tokens past `max_len` were dropped, `lengths` stops at
    `max_len`, and every public entry that takes a cache — an un-jitted model call, `check_overflow` —
    raises. (The Sampler builds its own cache and checks room before it starts.)

    `out_of_range[b]` counts, over every write to row b, the metadata values its format's metadata
    dtype could not hold (FP8 saturating at 448 or flushing to zero) plus non-finite K/V entries —
    for formats that report them (those with an `out_of_range` method: the `LoopQuant` family); it
    stays 0 for the others. Generation and eval print it; see `LoopQuant.super_scale` for the remedy.

    `steps[b, s]` (only in a cache built with `track_steps=True`, else None) is how many loops the
    token at position s computed: Huginn's adaptive exit stops a token early, and such a cache hides
    its skipped steps — attention at loop t sees only the positions with steps > t, the reference's
    default ("full") cache lookup. Without it, skipped steps read the token's last computed K/V
    (`latest-m4`); see `rq_jax.nn.huginn.AdaptiveExit.lookup`.
    """

    looped: tuple[Any, ...]
    plain: tuple[Any, ...] | None
    lengths: Int[Array, "b"]
    overflow: Bool[Array, "b"]
    out_of_range: Int[Array, "b"]
    steps: Int[Array, "b s"] | None
    fmt: base.CacheFormat = struct.field(pytree_node=False)
    plain_fmt: base.CacheFormat = struct.field(pytree_node=False)
    num_loops: int = struct.field(pytree_node=False)
    max_len: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)

    def schedule(self, group: Group) -> tuple[base.CacheFormat, tuple[base.Segment, ...]]:
        """The format and loop segments of the looped or plain layers."""
        if group == "looped":
            return self.fmt, base.segments(self.num_loops, self.fmt.group_len)
        return self.plain_fmt, base.segments(1, self.plain_fmt.group_len)

    def stack(self, group: Group) -> tuple[Any, ...] | None:
        """The stored state of the looped or plain layers (None: the model has no plain layers)."""
        return self.looped if group == "looped" else self.plain

    def slot_dims(self, group: Group) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of a stack, read off its first leaf [G, N, B, K, S, ...]."""
        leaf = jax.tree_util.tree_leaves(self.stack(group))[0]
        return leaf.shape[1], leaf.shape[3], self.head_dim

    def locate(self, group: Group, loop: int, layer: int) -> tuple[int, base.Index, int]:
        """(segment, (group, layer) index, position in group) of slot (loop, layer)."""
        for i, seg in enumerate(self.schedule(group)[1]):
            if seg.start <= loop < seg.start + seg.num_loops:
                g, r = divmod(loop - seg.start, seg.size)
                return i, (g, layer), r
        raise ValueError(f"loop {loop} outside 0..{self.num_loops - 1}")

    def read(self, group: Group, loop: int, layer: int, calib: "CacheCalib | None" = None) -> KV:
        """The stored K and V of slot (loop, layer) decoded to float32 [B, K, S, D] (0 past each row)."""
        fmt = self.schedule(group)[0]
        seg, index, r = self.locate(group, loop, layer)
        calib = _part(calib or CacheCalib(), group)
        return fmt.reconstruct(self.stack(group)[seg], index, r, self.lengths, None if calib is None else calib[seg])

    def dense_kv(self, group: Group = "looped") -> KV:
        """K and V [L, N, B, K, S, D] of a dense cache's looped (L = num_loops) or plain (L = 1) layers."""
        from rq_jax.cache.dense import Dense

        fmt = self.schedule(group)[0]
        if not isinstance(fmt, Dense):
            raise ValueError(f"dense_kv needs a dense cache, this one stores {group} layers as {fmt.name!r}")
        ((slot,),) = self.stack(group)
        return slot.k, slot.v


class CacheCalib(NamedTuple):
    """Static calibration of the looped and the plain (prelude/coda) layers: one entry per segment.

    A part is None when its format needs no calibration (e.g. dense).
    """

    looped: tuple[Any, ...] | None = None
    plain: tuple[Any, ...] | None = None


def _part(calib: CacheCalib, group: Group):
    return calib.looped if group == "looped" else calib.plain


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of the stored K/V and metadata, from the arrays themselves (the `lengths` counter excluded)."""
    return base.tree_nbytes((cache.looped, cache.plain))


def init_cache(config: ModelConfig, batch: int, max_len: int, fmt: base.CacheFormat | None = None, *,
               num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None,
               track_steps: bool = False) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens, run with `num_loops` loops.

    `fmt` stores the looped layers (default dense bf16); `plain_fmt` Huginn's prelude/coda (default
    `fmt`). `track_steps` records each token's computed loops and hides the skipped ones from later
    tokens (`KVCache.steps`). Raises ValueError if `max_len` exceeds the model's maximum position.
    """
    from rq_jax.cache.dense import Dense

    fmt = fmt or Dense()
    plain_fmt = plain_fmt or fmt
    num_loops = config.num_loops if num_loops is None else num_loops
    if max_len > config.max_position_embeddings:
        raise ValueError(f"cache max_len {max_len} exceeds the model's max positions "
                         f"{config.max_position_embeddings}")
    if batch <= 0 or max_len <= 0 or num_loops <= 0:
        raise ValueError(f"batch ({batch}), max_len ({max_len}) and num_loops ({num_loops}) must be positive")
    dims = (batch, max_len, config.num_kv_heads, config.head_dim)
    looped = tuple(fmt.init(seg, config.num_layers, *dims) for seg in base.segments(num_loops, fmt.group_len))
    plain = None
    if config.num_plain_layers:
        plain = tuple(plain_fmt.init(seg, config.num_plain_layers, *dims)
                      for seg in base.segments(1, plain_fmt.group_len))
    steps = jnp.zeros((batch, max_len), jnp.int32) if track_steps else None
    return KVCache(looped, plain, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
                   jnp.zeros((batch,), jnp.int32), steps, fmt, plain_fmt, num_loops, max_len, config.head_dim)


def check_overflow(cache: KVCache) -> None:
    """Raise ValueError if a compiled call overflowed `cache` (see `KVCache.overflow`); host-side."""
    rows = np.flatnonzero(np.asarray(cache.overflow))
    if rows.size:
        raise ValueError(f"cache rows {rows.tolist()} overflowed in an earlier compiled call: tokens past the "
                         f"cache's max_len {cache.max_len} were dropped; build a larger cache")


def default_calib(cache: KVCache) -> CacheCalib:
    """The formats' data-free calibration for `cache`, built once outside jit.

    Raises ValueError for a format that cannot run without data (fit it with `calibrate`).
    """

    def part(group: Group):
        fmt, segs = cache.schedule(group)
        if cache.stack(group) is None or not fmt.needs_calib:
            return None
        return tuple(fmt.default_calib(seg, *cache.slot_dims(group)) for seg in segs)

    return CacheCalib(part("looped"), part("plain"))


def calibrate(dense: KVCache, fmt: base.CacheFormat, plain_fmt: base.CacheFormat | None = None) -> CacheCalib:
    """Fit `fmt` (and `plain_fmt`, default `fmt`) on the K/V stored in a dense cache."""
    plain_fmt = plain_fmt or fmt

    def part(f: base.CacheFormat, group: Group, num_loops: int):
        if dense.stack(group) is None or not f.needs_calib:
            return None
        k, v = dense.dense_kv(group)
        return tuple(f.calibrate(seg, base.split_loops(k, seg), base.split_loops(v, seg), dense.lengths)
                     for seg in base.segments(num_loops, f.group_len))

    return CacheCalib(part(fmt, "looped", dense.num_loops), part(plain_fmt, "plain", 1))


def fake_quantized(dense: KVCache, fmt: base.CacheFormat, calib: tuple[Any, ...]) -> KVCache:
    """A dense cache whose looped K/V are replaced by what `fmt` would store and reconstruct, with
    straight-through gradients (the format's `fake_quant`, e.g. `LoopQuant`'s): attention to it sees
    the quantization error while `jax.grad` reaches the K/V. `calib` has one entry per segment of
    `fmt`; the plain layers are kept as they are."""
    k, v = dense.dense_kv()
    parts = [fmt.fake_quant(base.split_loops(k, seg), base.split_loops(v, seg), c)
             for seg, c in zip(base.segments(dense.num_loops, fmt.group_len), calib)]
    k_hat, v_hat = (jnp.concatenate([p[i].reshape(-1, *p[i].shape[2:]) for p in parts]) for i in (0, 1))
    ((slot,),) = dense.looped
    return dense.replace(looped=((slot._replace(k=k_hat.astype(slot.k.dtype), v=v_hat.astype(slot.v.dtype)),),))


def check_calib(cache: KVCache, calib: CacheCalib) -> None:
    """Raise ValueError unless every format of `cache` that reads a calibration has one per segment, of
    the type its `default_calib` builds (where it has one)."""
    for group in ("looped", "plain"):
        fmt, segs = cache.schedule(group)
        if cache.stack(group) is None or not fmt.needs_calib:
            continue
        given = _part(calib, group)
        if given is None:
            how = ("fit one with rq_jax.cache.calibrate" if fmt.needs_data else
                   "build it once with rq_jax.cache.default_calib(cache)")
            raise ValueError(f"the {fmt.name!r} cache format of the {group} layers needs calib=CacheCalib(...): {how}")
        if not isinstance(given, tuple) or len(given) != len(segs):
            raise ValueError(f"the {group} calibration must be a tuple with one entry per loop segment "
                             f"({len(segs)}), got {type(given).__name__}")
        if not fmt.needs_data:
            want = type(jax.eval_shape(lambda: fmt.default_calib(segs[0], *cache.slot_dims(group))))
            bad = [type(c).__name__ for c in given if type(c) is not want]
            if bad:
                raise ValueError(f"the {fmt.name!r} format of the {group} layers needs {want.__name__} "
                                 f"calibration, got {bad[0]}")


class CallContext(NamedTuple):
    """One forward call's view of the cache, built before tracing the loops and never mutated.

    `num_new[b]` of the call's T tokens of row b are real; `self_mask` [B, T, T] is causal and hides
    padding; `positions` [B, T] are absolute positions.
    """

    cache: KVCache | None
    calib: CacheCalib
    num_new: Int[Array, "b"]
    self_mask: Bool[Array, "b t t"]
    positions: Int[Array, "b t"]

    @classmethod
    def build(cls, cache: KVCache | None, num_new: Int[Array, "b"], num_tokens: int,
              calib: CacheCalib | None) -> "CallContext":
        """The context of a call of `num_tokens` tokens."""
        t = jnp.arange(num_tokens)
        mask = (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] < num_new[:, None, None])
        start = cache.lengths if cache is not None else jnp.zeros_like(num_new)
        return cls(cache, calib or CacheCalib(), num_new, mask, start[:, None] + t[None, :])

    def segments(self, group: Group, num_loops: int) -> tuple[base.Segment, ...]:
        """How the loops are grouped: the cache's segments, or one loop per group without a cache."""
        if self.cache is None:
            return base.segments(num_loops, 1)
        return self.cache.schedule(group)[1]

    def attend(self, group: Group, seg: int, index: base.Index, loop: int, q: Float[Array, "b t h d"],
               k: Float[Array, "b k t d"], v: Float[Array, "b k t d"],
               skipped: Bool[Array, "b t"] | None = None) -> Float[Array, "b t h d"]:
        """Attention of q over slot (segment `seg`, `index`, group position `loop`)'s past and this
        call's own K/V (k, v), merged exactly.

        In a cache that tracks steps (`KVCache.steps`) the past positions that skipped this loop are
        hidden, and so are this call's tokens marked `skipped` [B, T] (each still sees itself); the
        past is then read through the format's `reconstruct` (its semantic reference) under that mask.
        """
        mask = self.self_mask
        hide = self.cache is not None and self.cache.steps is not None and group == "looped"
        if hide and skipped is not None:
            mask = mask & (~skipped[:, None, :] | jnp.eye(mask.shape[1], dtype=bool)[None])
        out = base.dense_partial(q, k, v, mask)
        if self.cache is not None:
            fmt, segs = self.cache.schedule(group)
            state = self.cache.stack(group)[seg]
            calib = _part(self.calib, group)
            calib = None if calib is None else calib[seg]
            if hide:
                number = segs[seg].start + index[0] * segs[seg].size + loop  # the loop this slot holds
                past = base.reference_attend(fmt, state, index, loop, q, self.cache.lengths, calib,
                                             visible=self.cache.steps > number)
            else:
                past = fmt.attend(state, index, loop, q, self.cache.lengths, calib)
            out = base.merge(past, out)
        return base.finalize(out).astype(q.dtype)

    def finish(self, looped: tuple[KV, ...], plain: KV | None,
               steps_used: Int[Array, "b t"] | None = None) -> KVCache | None:
        """The cache with this call's K/V written and lengths advanced.

        looped: per segment, K and V [G, p, N, B, K, T, D]; plain: K and V [1, 1, N_plain, B, K, T, D];
        steps_used: loops each token computed (default all), recorded when the cache tracks steps.
        """
        c = self.cache
        if c is None:
            return None

        def write(group: Group, states, kvs):
            """The group's new states and the values its format reports out of range, per row."""
            fmt, calib = c.schedule(group)[0], _part(self.calib, group)
            new, lost = [], jnp.zeros_like(c.out_of_range)
            for i, (state, (k, v)) in enumerate(zip(states, kvs)):
                cal = None if calib is None else calib[i]
                new.append(fmt.write(state, k, v, c.lengths, self.num_new, cal))
                if hasattr(fmt, "out_of_range"):
                    lost = lost + fmt.out_of_range(k, v, self.num_new, cal)
            return tuple(new), lost

        new_plain, plain_lost = (None, 0) if c.plain is None else write("plain", c.plain, (plain,))
        new_looped, looped_lost = write("looped", c.looped, looped)
        steps = c.steps
        if steps is not None:
            used = jnp.full(self.positions.shape, c.num_loops, jnp.int32) if steps_used is None else steps_used
            steps = base.scatter_tokens(steps[None, None, :, None], used[None, None, :, None], c.lengths,
                                        self.num_new)[0, 0, :, 0]
        end = c.lengths + self.num_new
        return c.replace(looped=new_looped, plain=new_plain, lengths=jnp.minimum(end, c.max_len),
                         overflow=c.overflow | (end > c.max_len),
                         out_of_range=c.out_of_range + looped_lost + plain_lost, steps=steps)


def dense_equivalent_nbytes(config: ModelConfig, cache: KVCache, dtype: str = "bfloat16") -> int:
    """Bytes a dense cache of `dtype` with the same batch, length and loops would take (nothing allocated)."""
    from rq_jax.cache.dense import Dense

    shapes = jax.eval_shape(lambda: init_cache(config, cache.lengths.shape[0], cache.max_len, Dense(dtype),
                                               num_loops=cache.num_loops))
    leaves = jax.tree_util.tree_leaves((shapes.looped, shapes.plain))
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))
