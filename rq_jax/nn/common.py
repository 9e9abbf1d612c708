"""What both model families share: the output type, input checks, stacked layers and the loop engine.

The engine keeps the trace small and pure: the layers of a stack run under `jax.lax.scan` over their
stacked parameters (or over the layer index, each layer's own arrays picked by `jax.lax.switch`: `per_layer`),
and the loops of a cache segment under `jax.lax.scan` over its groups with the group's positions unrolled
(their storage widths differ). The K/V each attention produced come back as
scan outputs, [G, p, N, B, K, T, D] per segment, and are written to the cache once, after the loops.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib, check_calib
from rq_jax.cache.context import CacheContext, CallContext, ContextSource
from rq_jax.cache.kv import KV, Group, KVCache, check_overflow, init_cache
from rq_jax.config import ModelConfig
from rq_jax.nn.layers import Linear, linear, matmul, wide
from rq_jax.shapes import NumNew, Tokens

#: attend(q [B, T, H, D], k [B, K, T, D], v [B, K, T, D]) -> (o [B, T, H, D], the (k, v) to store);
#: the slot attention also takes `skipped` [B, T] (see `CacheContext.attend`).
Attend = Callable[..., tuple[Array, KV]]


class ModelOutput(NamedTuple):
    """Logits [B, T, V] (or [B, V] with `last_only`), the updated cache (None without one), and extras:
    family-specific ones, plus whatever a `context` leaves (a teacher-forced QAT pass: its K/V,
    `rq_jax.train.qat`)."""

    logits: Float[Array, "b t v"] | Float[Array, "b v"]
    cache: KVCache | None
    extras: dict[str, Array]


class LoopedModule(nnx.Module):
    """Base of Ouro and Huginn: `config`, `init_cache` and the names of its `stacked` modules (`stacks`)."""

    config: ModelConfig
    stacks: tuple[str, ...] = ()

    def init_cache(self, batch: int, max_len: int, fmt=None, *, num_loops: int | None = None,
                   plain_fmt=None, track_steps: bool = False) -> KVCache:
        """An empty cache for this model run with `num_loops` loops (see `rq_jax.cache.init_cache`)."""
        return init_cache(self.config, batch, max_len, fmt, num_loops=num_loops, plain_fmt=plain_fmt,
                          track_steps=track_steps)


def embedding_and_head(c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype) -> tuple[nnx.Embed, Linear | None]:
    """The token embedding N(0, init_std²) and the output projection (None when tied to the embedding)."""
    embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=param_dtype,
                      embedding_init=nnx.initializers.normal(c.init_std), rngs=rngs)
    head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, std=c.init_std, rngs=rngs,
                                                     dtype=dtype, param_dtype=param_dtype)
    return embed, head


def output_logits(embed: nnx.Embed, head: Linear | None, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
    """Logits in float32 (float64 for float64 x) through `head`, or the embedding's transpose when tied
    (weights as stored)."""
    logits = head(x) if head is not None else matmul(x, embed.embedding[...].T, embed.dtype or x.dtype)
    return logits.astype(wide(x.dtype))


def stacked(make: Callable[[], nnx.Module], n: int) -> nnx.Module | None:
    """One module holding `n` layers built by `make`, every parameter stacked on a leading [n] axis
    (the layout `scan_layers` runs and the converter maps); None for n = 0."""
    if n == 0:
        return None
    layers = [make() for _ in range(n)]
    graphdef = nnx.graphdef(layers[0])
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *map(nnx.state, layers)))


def per_layer(model: LoopedModule) -> LoopedModule:
    """`model` (not changed) as a new module whose `stacked` modules (its class's `stacks`) are `nnx.List`s of
    their layers, each layer's parameters arrays of their own (copies): what `scan_layers` runs without
    slicing a layer out of a stack at every step.

    XLA:CPU copies a dynamic slice of a stacked weight before a dot reads it, so a scanned stack copies
    every layer's weights at every loop: at Ouro-1.4B's widths (2 layers, float32) a 1-row decode step
    copied 1.6 GB and took 226 ms, 57 ms per layer (docs/performance.md). Each layer of the list is a
    branch of its own, so a program compiles the layer once per layer, not once per stack (residual decode
    at those widths: 2.7 → 3.6 s for 2 layers)."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)
    for name in out.stacks:
        stack = getattr(out, name)
        if stack is not None:
            layer, params = nnx.split(stack)
            n = jax.tree_util.tree_leaves(params)[0].shape[0]
            setattr(out, name, nnx.List([nnx.merge(layer, jax.tree_util.tree_map(lambda w, i=i: w[i], params))
                                         for i in range(n)]))
    return out


def scan_layers(layers: nnx.Module | nnx.List, x: Array,
                call: Callable[[nnx.Module, Array, Array, Any], tuple[Array, Any]],
                extra: Any = None) -> tuple[Array, Any]:
    """Run `x` through a `stacked` module's layers (or a `per_layer` list of them) under `jax.lax.scan`.

    `call(layer, i, x, extra_i) -> (x, out)` runs layer i (a traced index) on x, with `extra`'s slice
    i (a pytree with a leading [N] axis, or None). Returns the final x and the outputs stacked [N, ...].
    """
    if isinstance(layers, nnx.List):  # the index picks a branch reading that layer's own arrays
        n, per_step = len(layers), None

        def body(x, xs):
            _, i, e = xs
            return jax.lax.switch(i, [functools.partial(call, layer, i) for layer in layers], x, e)
    else:
        graphdef, params = nnx.split(layers)
        n = jax.tree_util.tree_leaves(params)[0].shape[0]
        # XLA:CPU widens a dynamic slice of bf16 to float32 and hoists the conversion of the whole stack
        # out of the loop: a float32 copy of every layer's weights in each call. Behind a barrier with the
        # layer index only the layer's slice is made (float32 stacks keep the plain scan, as training does).
        narrow = any(jnp.issubdtype(w.dtype, jnp.floating) and w.dtype.itemsize < 4
                     for w in jax.tree_util.tree_leaves(params))
        per_step = None if narrow else params

        def body(x, xs):
            p, i, e = xs
            if narrow:  # slice layer i out of the stacks inside the loop body
                p = jax.tree_util.tree_map(lambda w: w[i], jax.lax.optimization_barrier((params, i))[0])
            return call(nnx.merge(graphdef, p), i, x, e)

    if _REMAT.get():
        body = jax.checkpoint(body, prevent_cse=False)
    return jax.lax.scan(body, x, (per_step, jnp.arange(n), extra))


_REMAT = contextvars.ContextVar("rq_jax_remat_layers", default=False)


@contextlib.contextmanager
def remat_layers(enabled: bool = True):
    """While a forward is *traced* inside this context, `scan_layers` wraps each layer in
    `jax.checkpoint`: the backward pass recomputes a layer's activations from its input instead of
    keeping them, so training holds one layer's activations per scan step rather than all of them.
    Enter it inside the function being traced (a jitted loss), so every trace of it agrees."""
    token = _REMAT.set(enabled)
    try:
        yield
    finally:
        _REMAT.reset(token)


def run_loops(segments: tuple[base.Segment, ...], carry: Any,
              step: Callable[[Any, int, Array, int], tuple[Any, Any]]) -> tuple[Any, tuple[tuple[Any, ...], ...]]:
    """Run every loop: per segment a `jax.lax.scan` over its groups, the group's positions unrolled.

    `step(carry, segment, group, position) -> (carry, out)` runs one loop (`group` is traced).
    Returns the final carry and, per segment, a tuple over the group positions of the outputs stacked
    over the groups [G, ...]. Positions are kept apart: stacking them would copy every loop's
    in-flight K/V of a long prompt at once (`flatten_loops` stacks what is small).
    """
    outs = []
    for si, seg in enumerate(segments):
        def group(carry, g, si=si, seg=seg):
            results = []
            for r in range(seg.size):
                carry, out = step(carry, si, g, r)
                results.append(out)
            return carry, tuple(results)

        carry, out = jax.lax.scan(group, carry, jnp.arange(seg.groups))
        outs.append(out)
    return carry, tuple(outs)


def flatten_loops(per_segment: tuple[tuple[Any, ...], ...]) -> Any:
    """`run_loops`' outputs (per segment, per position [G, ...]) → one [L, ...] stack in loop order."""
    def segment(positions):
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]), *positions)

    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *map(segment, per_segment))


def slot_attend(ctx: CallContext, group: Group, seg: int, index: base.Index, loop: int) -> Attend:
    """The `Attend` of one slot: its stored past and the call's own K/V; stores the K/V it was given."""
    return lambda q, k, v, skipped=None: (ctx.attend(group, seg, index, loop, q, k, v, skipped), (k, v))


def start_call(tokens: Tokens, cache: KVCache | None, num_new: NumNew | None,
               num_loops: int, calib: CacheCalib | None, context: ContextSource | None = None) -> CallContext:
    """Check a forward call's shapes, loop count and calibration (at trace time), and build its context:
    a `CacheContext` over `cache` (or none), or the one `context` builds (a past that is not a cache).

    `num_new[b]` (default T) is how many of row b's T tokens are real; the rest are padding. Raises
    TypeError for a cache that is not a `KVCache`, ValueError for a bad shape or loop count, a loop
    count that differs from the cache's, both a cache and a context, or a missing or mismatched
    calibration. Value checks are `check_values`'s, made on the host before compiling.
    """
    check_cache_type(cache)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if isinstance(num_loops, bool) or not isinstance(num_loops, int) or num_loops < 1:
        raise ValueError(f"the loop count must be a positive integer, got {num_loops!r}")
    b, t = tokens.shape
    num_new = jnp.full((b,), t, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    if num_new.shape != (b,):
        raise ValueError(f"num_new must have shape ({b},), got {num_new.shape}")
    if context is not None:
        if cache is not None:
            raise ValueError("a call reads its past from a cache or from a context, not both")
        return context.call_context(num_new, t, num_loops)
    if cache is not None:
        if cache.lengths.shape != (b,):
            raise ValueError(f"cache was built for batch {cache.lengths.shape[0]}, tokens have batch {b}")
        if cache.num_loops != num_loops:
            raise ValueError(f"cache was built for {cache.num_loops} loops, this call runs {num_loops}")
        if t > cache.max_len:
            raise ValueError(f"{t} tokens do not fit in a cache of max_len {cache.max_len}")
        check_calib(cache, calib or CacheCalib())
    return CacheContext.build(cache, num_new, t, calib)


def check_cache_type(cache: Any) -> None:
    """Raise TypeError unless `cache` is a `KVCache` or None."""
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__} (a past that is not a cache, "
                        "e.g. rq_jax.train.qat.TeacherForced, goes in context=...)")


def check_values(tokens: Tokens, cache: KVCache | None, num_new: NumNew | None,
                 vocab_size: int) -> None:
    """Host-side value checks of an un-jitted call: token ids inside the vocabulary, a cache that did
    not overflow earlier and no tokens past its end (inside a compiled program none of these can raise,
    so `run` and the Sampler check first)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got ids from {tokens.min()} to {tokens.max()}")
    if isinstance(cache, KVCache) and tokens.ndim == 2:
        check_overflow(cache)
        if tokens.shape[1] > cache.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens do not fit in a cache of max_len {cache.max_len}")
        new = tokens.shape[1] if num_new is None else np.asarray(num_new)
        end = int(np.max(np.asarray(cache.lengths) + new))
        if end > cache.max_len:
            raise ValueError(f"prompt plus cached tokens ({end}) exceed the cache's max_len {cache.max_len}")


def run(model: "LoopedModule", tokens, cache: KVCache | None, dynamic: dict[str, Any],
        static: dict[str, Any]) -> ModelOutput:
    """A model call: traced inputs (inside the caller's jit, grad, scan ...) run `model._forward`
    directly; concrete ones are checked on the host (`check_values`) and run compiled, once per shape
    and static configuration. `dynamic` holds array arguments, `static` hashable ones."""
    check_cache_type(cache)
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((tokens, cache, dynamic)))
    if not concrete:
        return model._forward(tokens, cache, **dynamic, **static)
    check_values(tokens, cache, dynamic.get("num_new"), model.config.vocab_size)
    return _compiled(model, jnp.asarray(tokens), cache, dynamic, tuple(sorted(static.items())))


@functools.partial(nnx.jit, static_argnames="static")
def _compiled(model, tokens, cache, dynamic, static):
    return model._forward(tokens, cache, **dynamic, **dict(static))


def take_last(x: Float[Array, "... b t e"], num_new: NumNew) -> Float[Array, "... b e"]:
    """x at each row's last real token (index num_new[b] − 1, clamped at 0)."""
    idx = jnp.maximum(num_new - 1, 0).reshape((1,) * (x.ndim - 3) + (-1, 1, 1))
    return jnp.take_along_axis(x, idx, axis=-2)[..., 0, :]
