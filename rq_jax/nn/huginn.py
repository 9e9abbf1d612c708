"""Huginn-0125 ("recurrent depth"): prelude, a core block recurring `num_steps` times, coda.

    e = wte(ids) * embed_scale;  e = prelude(e)
    s = initial_state                               # zeros, or seeded truncated normal
    for step in range(num_steps): s = core(adapter(concat([s, e])))
    latent = ln_f(s);  logits = head(ln_f(coda(latent)))      # the same ln_f twice

Sandwich blocks norm the residual sum: x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x))).
Cache slots: core step t, block j → looped slot (t, j); prelude p → plain slot p; coda c → plain
slot num_prelude + c.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rq_jax.cache.kv import CallContext, Group, KVCache, init_cache
from rq_jax.config import ModelConfig
from rq_jax.nn import common
from rq_jax.nn.layers import RMSNorm, linear, rope_angles, rope_interleaved


class HuginnAttention(nnx.Module):
    """Fused Wqkv (rows q|k|v), per-head q/k bias before interleaved RoPE."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.init_std)
        self.Wqkv = linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, **kw)
        self.qk_bias = nnx.Param(jnp.zeros((2, 1, c.num_heads, c.head_dim), param_dtype)) if c.qk_bias else None
        self.proj = linear(c.hidden_size, c.hidden_size, **kw)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, x, angles, ctx: CallContext, group: Group, loop: int, layer: int):
        h, k, d = self.shape
        bt = x.shape[:2]
        q, key, value = jnp.split(self.Wqkv(x), [h * d, (h + k) * d], axis=-1)
        q, key, value = q.reshape(*bt, h, d), key.reshape(*bt, k, d), value.reshape(*bt, k, d)
        if self.qk_bias is not None:
            bias = self.qk_bias[...].astype(x.dtype)
            q, key = q + bias[0], key + bias[1]
        q, key = rope_interleaved(q, angles), rope_interleaved(key, angles)
        return self.proj(common.attend(ctx, group, loop, layer, q, key, value))


class HuginnMLP(nnx.Module):
    """proj(silu(a) * b) with [a | b] = fc(x)."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.init_std)
        self.fc = linear(c.hidden_size, 2 * c.intermediate_size, **kw)
        self.proj = linear(c.intermediate_size, c.hidden_size, **kw)

    def __call__(self, x):
        a, b = jnp.split(self.fc(x), 2, axis=-1)
        return self.proj(jax.nn.silu(a) * b)


class SandwichBlock(nnx.Module):
    """x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x)))."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        norm = lambda: RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)  # noqa: E731
        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = norm(), norm(), norm(), norm()
        self.attn = HuginnAttention(c, **kw)
        self.mlp = HuginnMLP(c, **kw)

    def __call__(self, x, angles, ctx: CallContext, group: Group, loop: int, layer: int):
        x = self.norm_2(x + self.attn(self.norm_1(x), angles, ctx, group, loop, layer))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class Huginn(nnx.Module):
    """Huginn causal LM. Call it with tokens [B, T] and an optional cache; see `__call__`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if config.family != "huginn":
            raise ValueError(f"Huginn needs a 'huginn' config, got family {config.family!r}")
        c = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wte = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=param_dtype,
                             embedding_init=nnx.initializers.normal(c.init_std), rngs=rngs)
        self.prelude = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_prelude)])
        self.adapter = linear(2 * c.hidden_size, c.hidden_size, std=c.init_std, **kw)
        self.core_block = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_layers)])
        self.coda = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_coda)])
        self.ln_f = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, std=c.init_std, **kw)

    def init_cache(self, batch: int, max_len: int, fmt=None, *, num_loops: int | None = None,
                   plain_fmt=None) -> KVCache:
        """An empty cache for this model run with `num_loops` core steps (see `rq_jax.cache.init_cache`)."""
        return init_cache(self.config, batch, max_len, fmt, num_loops=num_loops, plain_fmt=plain_fmt)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """ln_f then the (tied) output projection, logits in float32."""
        x = self.ln_f(x)
        out = self.wte.attend(x) if self.lm_head is None else self.lm_head(x)
        return out.astype(jnp.float32)

    def initial_state(self, embeds: Float[Array, "b t e"], rng: jax.Array | None, init_scale: float):
        """Zeros when `rng` is None or `init_scale` is 0, else a ±3σ truncated normal of σ = std·scale,
        times the embedding scale (the reference's `initialize_state`)."""
        if rng is None or init_scale == 0:
            return jnp.zeros_like(embeds)
        std = self.config.init_std * init_scale
        noise = jax.random.truncated_normal(rng, -3.0, 3.0, embeds.shape, jnp.float32) * std
        return (noise * self.config.embed_scale).astype(embeds.dtype)

    def __call__(self, tokens: Int[Array, "b t"], cache: KVCache | None = None, *,
                 num_new: Int[Array, "b"] | None = None, num_steps: int | None = None,
                 rng: jax.Array | None = None, init_scale: float = 1.0, last_only: bool = False,
                 calib: Any = None) -> common.ModelOutput:
        """Run `num_steps` core steps (default the config's mean recurrence) over tokens [B, T].

        The initial latent state is zeros unless `rng` is given. With a cache, token t of row b sits at
        position cache.lengths[b] + t and the first num_new[b] tokens are written. Returns logits
        [B, T, V] ([B, V] with `last_only`), the new cache, and extras `latents` [B, T, E] (ln_f of
        the final state, the coda's input).
        """
        c = self.config
        num_steps = num_steps or c.num_loops
        ctx = common.start_call(tokens, cache, num_new, num_steps, calib)
        angles = rope_angles(ctx.positions(), c.head_dim, c.rope_theta)
        e = self.wte(tokens) * jnp.asarray(c.embed_scale, self.wte.dtype)
        for p, block in enumerate(self.prelude):
            e = block(e, angles, ctx, "plain", 0, p)
        s = self.initial_state(e, rng, init_scale)
        for step in range(num_steps):
            s = self.adapter(jnp.concatenate([s, e], axis=-1))
            for j, block in enumerate(self.core_block):
                s = block(s, angles, ctx, "looped", step, j)
        x = latents = self.ln_f(s)
        for i, block in enumerate(self.coda):
            x = block(x, angles, ctx, "plain", 0, c.num_prelude + i)
        if last_only:
            x = common.take_last(x, ctx.num_new)
        return common.ModelOutput(self.head(x), ctx.finish(), dict(latents=latents))
