"""Per-loop queries, keys and values of a model's attention layers, and its per-head output metrics.

The model's forward pass returns the K/V it stores but not the queries, so `collect` drives the
model's own layer modules itself, in the same order as the model does (Ouro: loops × layers, the
final norm after each loop; Huginn: prelude, `num_loops` × (adapter, core blocks), coda), and hands
each attention module an `Attend` that computes the model's no-cache causal attention
(`CacheContext.attend` without a cache) and returns the queries with the K/V. Nothing in `rq_jax.nn`
changes; a test checks that the collected K/V equal those a dense cache stores.

Shapes: L loops · N layers · B rows · T tokens · H query heads · K kv heads · D head dim · E model
width. Keys are after RoPE (as the cache stores them), queries too (as attention reads them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from rq_jax.cache.context import CacheContext
from rq_jax.nn import common
from rq_jax.nn.layers import rope_table
from rq_jax.shapes import LoopKV


class Activations(NamedTuple):
    """One stack's attention inputs: q [L, N, B, T, H, D], k and v [L, N, B, K, T, D] (float32)."""

    q: Float[Array, "l n b t h d"]
    k: LoopKV
    v: LoopKV


class ModelActivations(NamedTuple):
    """The looped layers' activations (L = loops) and the plain ones' (Huginn's prelude then coda,
    L = 1; None for Ouro)."""

    looped: Activations
    plain: Activations | None

    def part(self, group: str) -> Activations | None:
        return self.looped if group == "looped" else self.plain


def _capture(ctx: CacheContext) -> common.Attend:
    """The no-cache causal attention of the model, returning (q, k, v) as what the layer "stores"."""
    return lambda q, k, v: (ctx.attend("looped", 0, (0, 0), 0, q, k, v), (q, k, v))


def _stack(kv) -> Activations:
    """Layer-stacked (q [N, B, T, H, D], k, v [N, B, K, T, D]) → float32 with a leading loop axis."""
    q, k, v = (x.astype(jnp.float32) for x in kv)
    return Activations(q[None], k[None], v[None]) if q.ndim == 5 else Activations(q, k, v)


def _ouro(model, tokens, num_loops: int, rng, init_scale: float) -> ModelActivations:
    del rng, init_scale  # Ouro is deterministic
    c = model.config
    ctx = CacheContext.build(None, jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32), tokens.shape[1], None)
    rope = rope_table(ctx.positions, c.head_dim, c.rope_theta)
    attend = _capture(ctx)

    def loop(h, _):
        h, qkv = common.scan_layers(model.layers, h, lambda layer, i, x, e: layer(x, rope, attend))
        return model.norm(h), qkv

    _, qkv = jax.lax.scan(loop, model.embed_tokens(tokens), None, length=num_loops)
    return ModelActivations(_stack(qkv), None)


def _huginn(model, tokens, num_loops: int, rng, init_scale: float) -> ModelActivations:
    c = model.config
    ctx = CacheContext.build(None, jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32), tokens.shape[1], None)
    rope = rope_table(ctx.positions, c.head_dim, c.rope_theta)
    attend = _capture(ctx)
    def block(layer, i, x, e):
        return layer(x, rope, attend)
    e = model.wte(tokens) * jnp.asarray(c.embed_scale, model.wte.dtype)
    plain = []
    if model.prelude is not None:
        e, qkv = common.scan_layers(model.prelude, e, block)
        plain.append(qkv)
    s = model.initial_state(e, rng, init_scale)

    def step(s, _):
        s = model.adapter(jnp.concatenate([s, e], axis=-1))
        return common.scan_layers(model.core_block, s, block)

    s, looped = jax.lax.scan(step, s, None, length=num_loops)
    if model.coda is not None:
        plain.append(common.scan_layers(model.coda, model.ln_f(s), block)[1])
    plain_acts = None
    if plain:
        plain_acts = _stack(tuple(jnp.concatenate(x) for x in zip(*plain)))
    return ModelActivations(_stack(looped), plain_acts)


@functools.partial(nnx.jit, static_argnames=("num_loops", "init_scale"))
def _collect(model, tokens, rng, num_loops: int, init_scale: float) -> ModelActivations:
    run = _ouro if model.config.family == "ouro" else _huginn
    return run(model, tokens, num_loops, rng, init_scale)


def collect(model, tokens: Int[np.ndarray, "b t"], num_loops: int | None = None, *, batch_size: int = 8,
            seed: int = 0, init_scale: float = 1.0) -> ModelActivations:
    """Queries, keys and values of every attention layer and loop for full rows `tokens` [B, T].

    Runs `batch_size` rows at a time (one compiled program; the last chunk is padded with copies and
    trimmed). Huginn's initial latent state is drawn as in generation (`init_scale` 1, per-row keys
    from `seed`; `init_scale=0` gives zeros). Returns float32 arrays (see `Activations`).
    """
    tokens = np.asarray(tokens, np.int32)
    vocab = model.config.vocab_size
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"calibration tokens must be [rows, time] with at least one row, got {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"calibration token ids must lie in [0, {vocab}), got {tokens.min()}..{tokens.max()}")
    num_loops = model.config.num_loops if num_loops is None else num_loops
    rows = tokens.shape[0]
    size = min(batch_size, rows)
    chunks = []
    for start in range(0, rows, size):
        chunk = tokens[start : start + size]
        pad = size - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
        rng = jax.random.fold_in(jax.random.key(seed), start)
        out = _collect(model, jnp.asarray(chunk), rng, num_loops=num_loops, init_scale=float(init_scale))
        chunks.append(jax.tree_util.tree_map(lambda x, pad=pad: x[:, :, : size - pad], out))
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=2), *chunks)


def _heads(kernel: Array, num_heads: int) -> Float[Array, "n h d d"]:
    """W_O W_Oᵀ per layer and query head from stacked output kernels [N, H·D, E]."""
    w = kernel.astype(jnp.float32).reshape(kernel.shape[0], num_heads, -1, kernel.shape[-1])
    return jnp.einsum("nhde,nhfe->nhdf", w, w, precision=jax.lax.Precision.HIGHEST)


def output_metrics(model) -> dict[str, Array | None]:
    """Per (layer, query head) the output-projection metric W_O,h W_O,hᵀ [N, H, D, D] (W_O,h the head's
    D × E slice), for the "looped" and "plain" stacks: ‖Δ W_O,h‖² = tr(Δ M Δᵀ)."""
    c = model.config
    if c.family == "ouro":
        return {"looped": _heads(model.layers.self_attn.o_proj.kernel[...], c.num_heads), "plain": None}
    stacks = [s for s in (model.prelude, model.coda) if s is not None]
    plain = jnp.concatenate([_heads(s.attn.proj.kernel[...], c.num_heads) for s in stacks]) if stacks else None
    return {"looped": _heads(model.core_block.attn.proj.kernel[...], c.num_heads), "plain": plain}
