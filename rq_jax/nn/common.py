"""What both model families share: the call's output type, input checks, and attention plumbing."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from flax import nnx

from rq_jax.cache.kv import CallContext, Group, KVCache, init_cache
from rq_jax.config import ModelConfig
from rq_jax.nn.layers import linear


class ModelOutput(NamedTuple):
    """Logits [B, T, V] (or [B, V] with `last_only`), the updated cache, and family-specific extras."""

    logits: Float[Array, "b t v"] | Float[Array, "b v"]
    cache: KVCache | None
    extras: dict[str, Array]


class LoopedModule(nnx.Module):
    """Base of Ouro and Huginn: `config` and `init_cache`."""

    config: ModelConfig

    def init_cache(self, batch: int, max_len: int, fmt=None, *, num_loops: int | None = None,
                   plain_fmt=None) -> KVCache:
        """An empty cache for this model run with `num_loops` loops (see `rq_jax.cache.init_cache`)."""
        return init_cache(self.config, batch, max_len, fmt, num_loops=num_loops, plain_fmt=plain_fmt)


def embedding_and_head(c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype) -> tuple[nnx.Embed, nnx.Linear | None]:
    """The token embedding N(0, init_std²) and the output projection (None when tied to the embedding)."""
    embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=param_dtype,
                      embedding_init=nnx.initializers.normal(c.init_std), rngs=rngs)
    head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, std=c.init_std, rngs=rngs,
                                                     dtype=dtype, param_dtype=param_dtype)
    return embed, head


def output_logits(embed: nnx.Embed, head: nnx.Linear | None, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
    """Logits in float32 through `head`, or the embedding's transpose when tied."""
    return (embed.attend(x) if head is None else head(x)).astype(jnp.float32)


def start_call(tokens: Int[Array, "b t"], cache: KVCache | None, num_new: Int[Array, "b"] | None,
               num_loops: int, calib: Any) -> CallContext:
    """Validate a forward call and build its `CallContext`.

    `num_new[b]` (default T) is how many of row b's T tokens are real; the rest are padding. Raises
    ValueError when the tokens do not fit in the cache or the loop count differs from the cache's.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    b, t = tokens.shape
    num_new = jnp.full((b,), t, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    if num_new.shape != (b,):
        raise ValueError(f"num_new must have shape ({b},), got {num_new.shape}")
    if cache is not None:
        if cache.lengths.shape != (b,):
            raise ValueError(f"cache was built for batch {cache.lengths.shape[0]}, tokens have batch {b}")
        if cache.num_loops != num_loops:
            raise ValueError(f"cache was built for {cache.num_loops} loops, this call runs {num_loops}")
        if t > cache.max_len:
            raise ValueError(f"{t} tokens do not fit in a cache of max_len {cache.max_len}")
        try:  # checkable only outside jit; inside, `scatter_tokens` drops what does not fit
            end = int(jnp.max(cache.lengths + num_new))
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
            end = 0
        if end > cache.max_len:
            raise ValueError(f"prompt plus cached tokens ({end}) exceed the cache's max_len {cache.max_len}")
    return CallContext(cache, num_new, t, calib)


def attend(ctx: CallContext, group: Group, loop: int, layer: int, q: Float[Array, "b t h d"],
           k: Float[Array, "b t k d"], v: Float[Array, "b t k d"]) -> Float[Array, "b t e"]:
    """Attention of RoPE'd q over the slot's past and this call's k/v; returns heads merged [B, T, H·D]."""
    o = ctx.attend(group, loop, layer, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    return o.reshape(*o.shape[:2], -1)


def take_last(x: Float[Array, "... b t e"], num_new: Int[Array, "b"]) -> Float[Array, "... b e"]:
    """x at each row's last real token (index num_new[b] − 1, clamped at 0)."""
    idx = jnp.maximum(num_new - 1, 0).reshape((1,) * (x.ndim - 3) + (-1, 1, 1))
    return jnp.take_along_axis(x, idx, axis=-2)[..., 0, :]
