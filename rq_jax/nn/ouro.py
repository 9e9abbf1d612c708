"""Ouro (ByteDance Seed): one stack of layers run `num_loops` times, final norm inside the loop, exit gate.

    h = embed(ids)
    for loop in range(L):
        for layer: h = h + norm_a2(attn(norm_a(h))); h = h + norm_m2(mlp(norm_m(h)))
        h = norm(h); hidden[loop] = h; gate[loop] = exit_gate(h)
    logits = lm_head(hidden[exit])        # by step, by threshold on the exit CDF, or weighted
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rq_jax.cache.context import ContextSource
from rq_jax.cache.kv import KVCache
from rq_jax.config import ModelConfig
from rq_jax.nn import common
from rq_jax.nn.layers import RMSNorm, linear, rope_half, rope_table
from rq_jax.shapes import NumNew, Tokens


@dataclasses.dataclass(frozen=True)
class ExitRule:
    """Which loop's hidden state produces the logits.

    kind "threshold": each token exits at the first loop whose exit CDF reaches `value` (else the last);
    "step": loop `value` for every token; "weighted": logits mixed by the exit distribution.
    """

    kind: Literal["threshold", "step", "weighted"] = "threshold"
    value: float = 1.0

    def __post_init__(self):
        if self.kind not in ("threshold", "step", "weighted"):
            raise ValueError(f"unknown exit kind {self.kind!r}: expected 'threshold', 'step' or 'weighted'")


def exit_distribution(gate_logits: Float[Array, "l b t"]) -> Float[Array, "l b t"]:
    """p_t = λ_t·∏_{s<t}(1 − λ_s) for t < L − 1 and the leftover mass at t = L − 1, λ = sigmoid(gate)."""
    lam = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
    survive = jnp.cumprod(1.0 - lam, axis=0)
    before = jnp.concatenate([jnp.ones_like(survive[:1]), survive[:-1]], axis=0)
    pdf = lam * before
    return pdf.at[-1].set(1.0 - jnp.sum(pdf[:-1], axis=0))


def exit_steps(pdf: Float[Array, "l b t"], threshold: float) -> Int[Array, "b t"]:
    """First loop whose cumulative exit probability reaches `threshold`, else the last loop."""
    reached = jnp.cumsum(pdf, axis=0) >= threshold
    last = pdf.shape[0] - 1
    return jnp.where(jnp.any(reached[:-1], axis=0), jnp.argmax(reached, axis=0), last)


class OuroAttention(nnx.Module):
    """Separate q/k/v/o projections, half-split RoPE, GQA."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.init_std)
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, **kw)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, **kw)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, **kw)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, **kw)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, x, rope, attend: common.Attend):
        """x [B, T, E] → (output [B, T, E], the stored K/V [B, K, T, D] each)."""
        h, k, d = self.shape
        bt = x.shape[:2]
        q = rope_half(self.q_proj(x).reshape(*bt, h, d), rope)
        key = rope_half(self.k_proj(x).reshape(*bt, k, d), rope)
        value = self.v_proj(x).reshape(*bt, k, d)
        o, kv = attend(q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3))
        return self.o_proj(o.reshape(*bt, h * d)), kv


class OuroMLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.init_std)
        self.gate_proj = linear(c.hidden_size, c.intermediate_size, **kw)
        self.up_proj = linear(c.hidden_size, c.intermediate_size, **kw)
        self.down_proj = linear(c.intermediate_size, c.hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroLayer(nnx.Module):
    """Pre-norm layer whose branch outputs are normed again before the residual add (four norms)."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        def norm():
            return RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)

        self.self_attn = OuroAttention(c, **kw)
        self.mlp = OuroMLP(c, **kw)
        self.input_layernorm, self.input_layernorm_2 = norm(), norm()
        self.post_attention_layernorm, self.post_attention_layernorm_2 = norm(), norm()

    def __call__(self, x, rope, attend: common.Attend):
        """x [B, T, E] → (x [B, T, E], the stored K/V)."""
        a, kv = self.self_attn(self.input_layernorm(x), rope, attend)
        x = x + self.input_layernorm_2(a)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x))), kv


class Ouro(common.LoopedModule):
    """Ouro causal LM. Call it with tokens [B, T] and an optional cache; see `__call__`."""

    stacks = ("layers",)

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if config.family != "ouro":
            raise ValueError(f"Ouro needs an 'ouro' config, got family {config.family!r}")
        c = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens, self.lm_head = common.embedding_and_head(c, **kw)
        self.layers = common.stacked(lambda: OuroLayer(c, **kw), c.num_layers)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.early_exit_gate = linear(c.hidden_size, 1, bias=True, std=c.init_std, **kw)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """Output logits in float32."""
        return common.output_logits(self.embed_tokens, self.lm_head, x)

    def __call__(self, tokens: Tokens, cache: KVCache | None = None, *,
                 num_new: NumNew | None = None, num_loops: int | None = None,
                 exit: ExitRule | None = None, last_only: bool = False, calib: Any = None,
                 rng: jax.Array | None = None, context: ContextSource | None = None) -> common.ModelOutput:
        """Run `num_loops` loops (default the config's) over tokens [B, T].

        With a cache, token t of row b sits at position cache.lengths[b] + t and the first num_new[b]
        tokens are written to the cache. Returns logits [B, T, V] ([B, V] at each row's last real
        token with `last_only`) under `exit` (default: the config's threshold), the new cache, and
        extras `hidden_steps` [L, B, T, E], `gate_logits` [L, B, T], `exit_pdf` [L, B, T], `exit_steps`
        [B, T]. `context` reads the past from something other than a cache (`rq_jax.cache.context`).
        Ouro is deterministic: `rng` is accepted for a signature shared with Huginn and unused.
        """
        return common.run(self, tokens, cache, dict(num_new=num_new, calib=calib, rng=rng, context=context),
                          dict(num_loops=num_loops, exit=exit, last_only=last_only))

    def _forward(self, tokens, cache, *, num_new, num_loops, exit, last_only, calib, rng,
                 context) -> common.ModelOutput:
        del rng  # Ouro is deterministic
        c = self.config
        num_loops = c.num_loops if num_loops is None else num_loops
        exit = exit or ExitRule("threshold", c.early_exit_threshold)
        ctx = common.start_call(tokens, cache, num_new, num_loops, calib, context)
        rope = rope_table(ctx.positions, c.head_dim, c.rope_theta, self.embed_tokens.dtype)

        def loop(h, seg, g, r):
            def layer(module, i, h, _):
                return module(h, rope, common.slot_attend(ctx, "looped", seg, (g, i), r))

            h, kv = common.scan_layers(self.layers, h, layer)
            h = self.norm(h)
            return h, (h, self.early_exit_gate(h)[..., 0].astype(jnp.float32), kv)

        h, outs = common.run_loops(ctx.segments("looped", num_loops), self.embed_tokens(tokens), loop)
        hidden, gates = common.flatten_loops(tuple(tuple(o[:2] for o in seg) for seg in outs))
        new_cache, left = ctx.finish(tuple(tuple(o[2] for o in seg) for seg in outs), None)
        pdf = exit_distribution(gates)
        steps = jnp.broadcast_to(jnp.int32(0), pdf.shape[1:])
        if exit.kind == "weighted":
            chosen = jnp.einsum("lbt,lbte->bte", pdf, hidden.astype(jnp.float32)).astype(h.dtype)
        else:
            if exit.kind == "step":
                if not 0 <= int(exit.value) < num_loops:
                    raise ValueError(f"exit step {exit.value} outside 0..{num_loops - 1}")
                steps = steps + int(exit.value)
            else:
                steps = exit_steps(pdf, exit.value)
            chosen = jnp.take_along_axis(hidden, steps[None, :, :, None], axis=0)[0]
        if last_only:
            chosen = common.take_last(chosen, ctx.num_new)
        extras = dict(hidden_steps=hidden, gate_logits=gates, exit_pdf=pdf, exit_steps=steps, **left)
        return common.ModelOutput(self.head(chosen), new_cache, extras)
