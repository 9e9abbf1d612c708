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

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv import KV, Group, KVCache


class CallContext(Protocol):
    """One forward call's view of its past. `num_new[b]` of the call's T tokens of row b are real;
    `positions` [B, T] are their absolute positions."""

    num_new: Int[Array, "b"]
    positions: Int[Array, "b t"]

    def segments(self, group: Group, num_loops: int) -> tuple[base.Segment, ...]:
        """How the call's loops are grouped into segments (the model scans a segment's groups)."""

    def attend(self, group: Group, seg: int, index: base.Index, loop: int, q: Float[Array, "b t h d"],
               k: Float[Array, "b k t d"], v: Float[Array, "b k t d"],
               skipped: Bool[Array, "b t"] | None = None) -> Float[Array, "b t h d"]:
        """Attention of q over slot (segment `seg`, `index`, group position `loop`)'s past and this
        call's own K/V (k, v), merged exactly."""

    def finish(self, looped: tuple[KV, ...], plain: KV | None,
               steps_used: Int[Array, "b t"] | None = None) -> tuple[KVCache | None, dict[str, Any]]:
        """What the call leaves: the updated cache (or None) and extras for `ModelOutput.extras`.
        looped: per segment, K and V [G, p, N, B, K, T, D]; plain: [1, 1, N_plain, B, K, T, D]."""


class ContextSource(Protocol):
    """A past that is not a `KVCache` (passed as a model's `context`): it builds the call's context."""

    def call_context(self, num_new: Int[Array, "b"], num_tokens: int, num_loops: int) -> CallContext:
        """The context of a call of `num_tokens` tokens (`num_new[b]` real) running `num_loops` loops."""


def causal_mask(num_new: Int[Array, "b"], num_tokens: int) -> Bool[Array, "b t t"]:
    """Query t may see in-flight key s ≤ t when s is a real token (s < num_new[b])."""
    t = jnp.arange(num_tokens)
    return (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] < num_new[:, None, None])


def attend_with_past(q: Float[Array, "b t h d"], k: Float[Array, "b k t d"], v: Float[Array, "b k t d"],
                     self_mask: Bool[Array, "b t t"], past: base.Partial | None) -> Float[Array, "b t h d"]:
    """Attention output of q over the in-flight K/V (under `self_mask`) merged exactly with the softmax
    partial over the stored past (None: no past), in q's dtype."""
    out = base.dense_partial(q, k, v, self_mask)
    if past is not None:
        out = base.merge(past, out)
    return base.finalize(out).astype(q.dtype)


class CacheContext(NamedTuple):
    """A call's view of a `KVCache` (or of none), built before tracing the loops and never mutated.

    `self_mask` [B, T, T] is causal and hides padding; `positions` [B, T] follow each row's length.
    """

    cache: KVCache | None
    calib: CacheCalib
    num_new: Int[Array, "b"]
    self_mask: Bool[Array, "b t t"]
    positions: Int[Array, "b t"]

    @classmethod
    def build(cls, cache: KVCache | None, num_new: Int[Array, "b"], num_tokens: int,
              calib: CacheCalib | None) -> "CacheContext":
        """The context of a call of `num_tokens` tokens."""
        start = cache.lengths if cache is not None else jnp.zeros_like(num_new)
        positions = start[:, None] + jnp.arange(num_tokens)[None, :]
        return cls(cache, calib or CacheCalib(), num_new, causal_mask(num_new, num_tokens), positions)

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
        past = None
        if self.cache is not None:
            fmt, segs = self.cache.schedule(group)
            state = self.cache.stack(group)[seg]
            calib = self.calib.part(group)
            calib = None if calib is None else calib[seg]
            if hide:
                number = segs[seg].start + index[0] * segs[seg].size + loop  # the loop this slot holds
                past = base.reference_attend(fmt, state, index, loop, q, self.cache.lengths, calib,
                                             visible=self.cache.steps > number)
            else:
                past = fmt.attend(state, index, loop, q, self.cache.lengths, calib)
        return attend_with_past(q, k, v, mask, past)

    def finish(self, looped: tuple[KV, ...], plain: KV | None,
               steps_used: Int[Array, "b t"] | None = None) -> tuple[KVCache | None, dict[str, Any]]:
        """The cache with this call's K/V written and lengths advanced (None without a cache), no extras.

        looped: per segment, K and V [G, p, N, B, K, T, D]; plain: K and V [1, 1, N_plain, B, K, T, D];
        steps_used: loops each token computed (default all), recorded when the cache tracks steps.
        """
        c = self.cache
        if c is None:
            return None, {}

        def write(group: Group, states, kvs):
            """The group's new states and the values its format reports out of range, per row."""
            fmt, calib = c.schedule(group)[0], self.calib.part(group)
            new, lost = [], jnp.zeros_like(c.out_of_range)
            for i, (state, (k, v)) in enumerate(zip(states, kvs)):
                written = fmt.write(state, k, v, c.lengths, self.num_new, None if calib is None else calib[i])
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
        return c.replace(looped=new_looped, plain=new_plain, lengths=jnp.minimum(end, c.max_len),
                         overflow=c.overflow | (end > c.max_len),
                         out_of_range=c.out_of_range + looped_lost + plain_lost, steps=steps), {}
