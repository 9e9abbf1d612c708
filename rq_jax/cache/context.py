"""What one model call sees of the past: the `CallContext` protocol, its cache implementation, and the
one exact merge of past and in-flight attention both implementations use.

A model call builds its context before tracing its loops and asks it, at every attention, for the
output over the stored past ⊕ the call's own (in-flight, full-precision) K/V, and at the end for
what the call leaves behind. `CacheContext` reads and writes a `KVCache`; a teacher-forced QAT pass
(`rq_jax.train.qat.TeacherForced`) reads earlier "calls" from fake-quantized K/V of a previous pass
and returns the pass's K/V. A model takes the first through its `cache` argument, anything else
through its `context` argument (a `ContextSource`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv import KV, Group, KVCache
from rq_jax.shapes import Attended, CallMask, Lengths, NewKV, NumNew, Positions, Queries


class CallContext(Protocol):
    """One forward call's view of its past. `num_new[b]` of the call's T tokens of row b are real;
    `positions` [B, T] are their absolute positions."""

    num_new: NumNew
    positions: Positions

    def segments(self, group: Group, num_loops: int) -> tuple[base.Segment, ...]:
        """How the call's loops are grouped into segments (the model scans a segment's groups)."""

    def attend(self, group: Group, seg: int, index: base.Index, loop: int, q: Queries,
               k: NewKV, v: NewKV, skipped: Bool[Array, "b t"] | None = None) -> Attended:
        """Attention of q over slot (segment `seg`, `index`, group position `loop`)'s past and this
        call's own K/V (k, v), merged exactly."""

    def finish(self, looped: tuple[tuple[KV, ...], ...], plain: KV | None,
               steps_used: Int[Array, "b t"] | None = None) -> tuple[KVCache | None, dict[str, Any]]:
        """What the call leaves: the updated cache (or None) and extras for `ModelOutput.extras`.
        looped: per segment, per group position, K and V [G, N, B, K, T, D] (`common.run_loops`' layout);
        plain: [1, 1, N_plain, B, K, T, D]."""


class ContextSource(Protocol):
    """A past that is not a `KVCache` (passed as a model's `context`): it builds the call's context."""

    def call_context(self, num_new: NumNew, num_tokens: int, num_loops: int) -> CallContext:
        """The context of a call of `num_tokens` tokens (`num_new[b]` real) running `num_loops` loops."""


#: Queries (and keys) of a call's own tokens attended to at once: a call of more tokens (a long prompt)
#: runs query tiles × key tiles with an online softmax, skipping the tiles above the diagonal, so its
#: scores never exceed [B, 512, H, 512]; shorter calls (decode steps, training windows) take one tile.
SELF_TILE = 512
#: Tokens encoded by one `write` when a call stores more (`write_in_chunks`).
WRITE_CHUNK = 512


class SelfMask(NamedTuple):
    """Which of a call's own T tokens query t sees, as a rule rather than a [B, T, T] array: key s ≤ t
    that is real (s < num_new[b]) and, where `hidden` [B, T] marks it, only as itself (a token that
    skipped this loop, `KVCache.steps`)."""

    num_new: NumNew
    hidden: Bool[Array, "b t"] | None = None

    def block(self, q0: Int[Array, ""] | int, tq: int, k0: Int[Array, ""] | int, tk: int) -> Bool[Array, "b tq tk"]:
        """The mask of queries q0 .. q0 + tq − 1 against keys k0 .. k0 + tk − 1."""
        qi, ki = q0 + jnp.arange(tq)[:, None], k0 + jnp.arange(tk)[None, :]
        mask = (qi >= ki)[None] & (ki < self.num_new[:, None, None])
        if self.hidden is not None:
            hidden = jax.lax.dynamic_slice_in_dim(self.hidden, k0, tk, axis=1)
            mask = mask & (~hidden[:, None, :] | (qi == ki)[None])
        return mask


def causal_mask(num_new: NumNew, num_tokens: int) -> CallMask:
    """Query t may see in-flight key s ≤ t when s is a real token (s < num_new[b])."""
    return SelfMask(num_new).block(0, num_tokens, 0, num_tokens)


def attend_with_past(q: Queries, k: NewKV, v: NewKV, self_mask: CallMask | SelfMask,
                     past: base.Partial | None) -> Attended:
    """Attention output of q over the in-flight K/V (under `self_mask`) merged exactly with the softmax
    partial over the stored past (None: no past), in q's dtype. A `SelfMask` over more than `SELF_TILE`
    tokens is attended tile by tile (`_tiled_self`)."""
    t = q.shape[1]
    if isinstance(self_mask, SelfMask):
        if t > SELF_TILE:
            return _tiled_self(q, k, v, self_mask, past, SELF_TILE)
        self_mask = self_mask.block(0, t, 0, t)
    out = base.dense_partial(q, k, v, self_mask)
    if past is not None:
        out = base.merge(past, out)
    return base.finalize(out).astype(q.dtype)


def _tiled_self(q: Queries, k: NewKV, v: NewKV, mask: SelfMask, past: base.Partial | None, tile: int) -> Attended:
    """`attend_with_past` over query tiles × key tiles (tile ≤ T): each query tile folds in the key
    tiles at or below the diagonal (the others are skipped by a `lax.cond`), then its rows of `past`.
    The last tile of a call that `tile` does not divide ends at T (its rows are computed twice, and an
    earlier key tile's keys are masked out). Static trip counts: differentiable."""
    b, t, h, d = q.shape
    count = -(-t // tile)

    def query_tile(out, i):
        q0 = jnp.minimum(i * tile, t - tile)
        rows = jax.lax.dynamic_slice_in_dim(q, q0, tile, axis=1)

        def key_tile(acc, j):
            k0 = jnp.minimum(j * tile, t - tile)

            def fold(acc):
                keys, values = (jax.lax.dynamic_slice_in_dim(x, k0, tile, axis=2) for x in (k, v))
                new = (k0 + jnp.arange(tile) >= j * tile)[None, None, :]
                return base.merge(acc, base.dense_partial(rows, keys, values, mask.block(q0, tile, k0, tile) & new))

            return jax.lax.cond(j * tile < q0 + tile, fold, lambda acc: acc, acc), None

        acc = jax.lax.scan(key_tile, base.empty_partial(b, tile, h, d), jnp.arange(count))[0]
        if past is not None:
            acc = base.merge(jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, q0, tile, axis=1), past),
                             acc)
        return jax.lax.dynamic_update_slice_in_dim(out, base.finalize(acc).astype(q.dtype), q0, axis=1), None

    return jax.lax.scan(query_tile, jnp.zeros_like(q), jnp.arange(count))[0]


def write_in_chunks(fmt: base.CacheFormat, state: tuple[Any, ...], kv: tuple[KV, ...], lengths: Lengths,
                    num_new: NumNew, calib: Any, chunk: int = WRITE_CHUNK, table: base.Table | None = None
                    ) -> base.Written:
    """`fmt.write` of a call's K/V, given per group position (`kv`: (k, v) [G, N, B, K, T, D] each),
    `chunk` tokens at a time (a loop over the full chunks, then the rest): each chunk's positions are
    stacked [G, p, N, B, K, chunk, D] and encoded, so neither the stacking nor the encoder ever holds
    more than a chunk. Every format's state depends only on the tokens and where they land, not on how the
    writes were split. The loop carries the state on its bits (`base.bits_of`), so that the writes' own
    bitcasts (`base.on_bits`) fold into the carry's and no chunk copies a leaf. `table`: a paged cache's
    block table (the writes go through it)."""
    t = kv[0][0].shape[4]
    bits, dtypes = base.tree_bits(state)

    def write(carry, start, size):
        bits, lost = carry
        part = (jnp.stack([jax.lax.dynamic_slice_in_dim(x[i], start, size, axis=4) for x in kv], axis=1)
                for i in (0, 1))
        done = jnp.minimum(num_new, start)  # tokens of each row written by the chunks before
        written = fmt.write(base.tree_values(bits, dtypes), *part, lengths + done,
                            jnp.clip(num_new - start, 0, size), calib, table)
        return base.tree_bits(written.state)[0], lost + written.out_of_range

    carry = (bits, jnp.zeros_like(lengths))
    if t <= chunk:
        carry = write(carry, 0, t)
    else:
        full = t // chunk
        carry = jax.lax.fori_loop(0, full, lambda i, c: write(c, i * chunk, chunk), carry)
        if t > full * chunk:
            carry = write(carry, full * chunk, t - full * chunk)
    return base.Written(base.tree_values(carry[0], dtypes), carry[1])


def in_flight_positions(kv: KV | tuple[KV, ...], size: int) -> tuple[KV, ...]:
    """A segment's in-flight K/V per group position: given so ((k, v) [G, N, B, K, T, D] per position,
    as the models give it), or stacked (k, v) [G, p, N, B, K, T, D]."""
    if isinstance(kv[0], tuple):
        return tuple(kv)
    return tuple((kv[0][:, r], kv[1][:, r]) for r in range(size))


class CacheContext(NamedTuple):
    """A call's view of a `KVCache` (or of none), built before tracing the loops and never mutated.

    `self_mask` is causal and hides padding; `positions` [B, T] follow each row's length.
    """

    cache: KVCache | None
    calib: CacheCalib
    num_new: NumNew
    self_mask: SelfMask
    positions: Positions

    @classmethod
    def build(cls, cache: KVCache | None, num_new: NumNew, num_tokens: int,
              calib: CacheCalib | None) -> "CacheContext":
        """The context of a call of `num_tokens` tokens."""
        start = cache.lengths if cache is not None else jnp.zeros_like(num_new)
        positions = start[:, None] + jnp.arange(num_tokens)[None, :]
        return cls(cache, calib or CacheCalib(), num_new, SelfMask(num_new), positions)

    def segments(self, group: Group, num_loops: int) -> tuple[base.Segment, ...]:
        """How the loops are grouped: the cache's segments, or one loop per group without a cache."""
        if self.cache is None:
            return base.segments(num_loops, 1)
        return self.cache.schedule(group)[1]

    def attend(self, group: Group, seg: int, index: base.Index, loop: int, q: Queries,
               k: NewKV, v: NewKV, skipped: Bool[Array, "b t"] | None = None) -> Attended:
        """Attention of q over slot (segment `seg`, `index`, group position `loop`)'s past and this
        call's own K/V (k, v), merged exactly.

        In a cache that tracks steps (`KVCache.steps`) the past positions that skipped this loop are
        hidden (the format's `attend` under a `visible` mask), and so are this call's tokens marked
        `skipped` [B, T] (each still sees itself).
        """
        mask = self.self_mask
        hide = self.cache is not None and self.cache.steps is not None and group == "looped"
        if hide and skipped is not None:
            mask = mask._replace(hidden=skipped)
        past = None
        if self.cache is not None:
            fmt, segs = self.cache.schedule(group)
            state = self.cache.values(group)[seg]
            calib = self.calib.part(group)
            calib = None if calib is None else calib[seg]
            visible = None
            if hide:
                number = segs[seg].start + index[0] * segs[seg].size + loop  # the loop this slot holds
                visible = self.cache.steps > number
            past = fmt.attend(state, index, loop, q, self.cache.lengths, calib, visible, self.cache.block_table)
        return attend_with_past(q, k, v, mask, past)

    def finish(self, looped: tuple[tuple[KV, ...] | KV, ...], plain: KV | None,
               steps_used: Int[Array, "b t"] | None = None) -> tuple[KVCache | None, dict[str, Any]]:
        """The cache with this call's K/V written and lengths advanced (None without a cache), no extras.

        looped: per segment, K and V per group position [G, N, B, K, T, D] (or stacked [G, p, N, B, K,
        T, D], `in_flight_positions`); plain: K and V [1, 1, N_plain, B, K, T, D]; steps_used: loops
        each token computed (default all), recorded when the cache tracks steps. The K/V are written a
        chunk of tokens at a time (`write_in_chunks`).
        """
        if self.cache is None:
            return None, {}
        c = self.cache.as_values()

        def write(group: Group, states, kvs):
            """The group's new states and the values its format reports out of range, per row."""
            (fmt, segs), calib = c.schedule(group), self.calib.part(group)
            new, lost = [], jnp.zeros_like(c.out_of_range)
            for i, (state, kv) in enumerate(zip(states, kvs)):
                part = None if calib is None else calib[i]
                written = write_in_chunks(fmt, state, in_flight_positions(kv, segs[i].size), c.lengths, self.num_new,
                                          part, table=c.block_table)
                new.append(written.state)
                lost = lost + written.out_of_range
            return tuple(new), lost

        new_plain, plain_lost = (None, 0) if c.plain is None else write("plain", c.plain, (plain,))
        new_looped, looped_lost = write("looped", c.looped, looped)
        steps = c.steps
        if steps is not None:
            used = jnp.full(self.positions.shape, c.num_loops, jnp.int32) if steps_used is None else steps_used
            steps = base.scatter_tokens(steps[None, None, :, None], used[None, None, :, None], c.lengths,
                                        self.num_new)[0, 0, :, 0]
        end = c.lengths + self.num_new
        c = c.replace(looped=new_looped, plain=new_plain, lengths=jnp.minimum(end, c.max_len),
                      overflow=c.overflow | (end > c.max_len), out_of_range=c.out_of_range + looped_lost + plain_lost,
                      steps=steps)
        return (c if self.cache.bit_dtypes is None else c.as_bits()), {}
