"""Huginn-0125 ("recurrent depth"): prelude, a core block recurring `num_steps` times, coda.

    e = wte(ids) * embed_scale;  e = prelude(e)
    s = initial_state                               # zeros, or seeded truncated normal
    for step in range(num_steps): s = core(adapter(concat([s, e])))
    latent = ln_f(s);  logits = head(ln_f(coda(latent)))      # the same ln_f twice

Sandwich blocks norm the residual sum: x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x))).
Cache slots: core step t, block j → looped slot (t, j); prelude p → plain slot p; coda c → plain
slot num_prelude + c.

Adaptive compute (`AdaptiveExit`): each token stops its recurrence once a convergence criterion
fires; its later steps' K/V repeat those of its last computed step (the reference's `latest-m4`
lookup, materialised), so the cache stays complete for every format.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rq_jax.cache.kv import CallContext, Group, KVCache
from rq_jax.config import ModelConfig
from rq_jax.nn import common
from rq_jax.nn.layers import RMSNorm, linear, rope_angles, rope_interleaved


#: The reference's default ("auto") threshold of each criterion.
DEFAULT_THRESHOLDS = {"kl": 5e-4, "entropy-diff": 1e-3, "latent-diff": 0.03, "argmax-stability": 5}


@dataclasses.dataclass(frozen=True)
class AdaptiveExit:
    """Per-token early exit of the core recurrence (the reference's `generate_with_adaptive_compute`).

    After every core step the criterion compares the token's step with the previous one and the token
    exits when it fires (an exit after step i uses i + 1 steps):
      "kl": KL(previous next-token distribution ‖ current) < threshold; the distribution before the
          first step is uniform over the vocabulary (default 5e-4).
      "entropy-diff": |entropy − previous entropy| < threshold, previous entropy 100 at first
          (default 1e-3).
      "latent-diff": ‖s_prev − s‖ / ‖s‖ < threshold for the latent state s, s_prev the state before
          the step (default 0.03).
      "argmax-stability": the argmax of the logits unchanged for ≥ threshold consecutive steps
          (default 5).
    `threshold` None takes the criterion's default. Raises ValueError for an unknown criterion.
    """

    criterion: str = "kl"
    threshold: float | None = None

    def __post_init__(self):
        if self.criterion not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown adaptive-exit criterion {self.criterion!r}: expected one of "
                             f"{', '.join(repr(c) for c in DEFAULT_THRESHOLDS)}")
        if self.threshold is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLDS[self.criterion])
        if not math.isfinite(self.threshold):
            raise ValueError(f"adaptive-exit threshold must be finite, got {self.threshold}")


class _ExitTracker(NamedTuple):
    """Per-token criterion state, [B, T] (log_probs [B, T, V])."""

    log_probs: Float[Array, "b t v"]
    entropy: Float[Array, "b t"]
    argmax: Int[Array, "b t"]
    stable: Int[Array, "b t"]


def _exit_fires(rule: AdaptiveExit, tracker: _ExitTracker, logits: Float[Array, "b t v"],
                s_prev: Float[Array, "b t e"], s: Float[Array, "b t e"]) -> tuple[Bool[Array, "b t"], _ExitTracker]:
    """Whether each token's criterion fires after this step, and the updated criterion state."""
    if rule.criterion == "kl":
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        value = jnp.sum(jnp.exp(tracker.log_probs) * (tracker.log_probs - log_probs), axis=-1)
        return value < rule.threshold, tracker._replace(log_probs=log_probs)
    if rule.criterion == "entropy-diff":
        probs = jax.nn.softmax(logits, axis=-1)
        entropy = -jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
        return jnp.abs(entropy - tracker.entropy) < rule.threshold, tracker._replace(entropy=entropy)
    if rule.criterion == "latent-diff":
        s_prev, s = s_prev.astype(jnp.float32), s.astype(jnp.float32)
        value = jnp.linalg.norm(s_prev - s, axis=-1) / jnp.linalg.norm(s, axis=-1)
        return value < rule.threshold, tracker
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    stable = jnp.where(argmax == tracker.argmax, tracker.stable + 1, 0)
    return stable >= rule.threshold, tracker._replace(argmax=argmax, stable=stable)


class _FrozenKV:
    """A `CallContext` view that keeps exited tokens' K/V at their last computed values.

    While `exited` [B, T] is set, an attention call for looped slot (t, j) records, for exited tokens,
    the in-flight K/V of slot (t − 1, j) (by induction their last computed step: `latest-m4`), and a
    plain (coda) slot keeps its previous in-flight K/V. Other tokens of the call attend to those.
    """

    def __init__(self, ctx: CallContext):
        self.ctx, self.exited = ctx, None

    def attend(self, group: Group, loop: int, layer: int, q, k, v):
        prev = self.ctx.inflight.get((group, loop - 1, layer) if group == "looped" else (group, loop, layer))
        if self.exited is not None and prev is not None:
            frozen = self.exited[:, None, :, None]
            k, v = jnp.where(frozen, prev[0], k), jnp.where(frozen, prev[1], v)
        return self.ctx.attend(group, loop, layer, q, k, v)


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


class Huginn(common.LoopedModule):
    """Huginn causal LM. Call it with tokens [B, T] and an optional cache; see `__call__`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if config.family != "huginn":
            raise ValueError(f"Huginn needs a 'huginn' config, got family {config.family!r}")
        c = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wte, self.lm_head = common.embedding_and_head(c, **kw)
        self.prelude = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_prelude)])
        self.adapter = linear(2 * c.hidden_size, c.hidden_size, std=c.init_std, **kw)
        self.core_block = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_layers)])
        self.coda = nnx.List([SandwichBlock(c, **kw) for _ in range(c.num_coda)])
        self.ln_f = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """ln_f then the (tied) output projection, logits in float32."""
        return common.output_logits(self.wte, self.lm_head, self.ln_f(x))

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
                 calib: Any = None, adaptive: AdaptiveExit | None = None) -> common.ModelOutput:
        """Run `num_steps` core steps (default the config's mean recurrence) over tokens [B, T].

        The initial latent state is zeros unless `rng` is given. With a cache, token t of row b sits at
        position cache.lengths[b] + t and the first num_new[b] tokens are written. Returns logits
        [B, T, V] ([B, V] with `last_only`), the new cache, and extras `latents` [B, T, E] (ln_f of
        the final state, the coda's input).

        With `adaptive`, every token stops at the step where its criterion fires (see
        `AdaptiveExit`): its state, logits and K/V stay those of that step, its later looped slots
        hold its last computed step's K/V, and extras add `steps_used` [B, T] int32 (core steps each
        token computed, 1..num_steps). All steps still run for the batch (static shapes) and the coda
        and head run after every step to evaluate the criterion. It is meant for decode (T = 1), as in
        the reference; with T > 1 tokens exit independently, and a token's criterion at step i sees
        the other tokens of the call at step i (or frozen at their exit).
        """
        c = self.config
        num_steps = num_steps or c.num_loops
        ctx = common.start_call(tokens, cache, num_new, num_steps, calib)
        angles = rope_angles(ctx.positions(), c.head_dim, c.rope_theta)
        e = self.wte(tokens) * jnp.asarray(c.embed_scale, self.wte.dtype)
        for p, block in enumerate(self.prelude):
            e = block(e, angles, ctx, "plain", 0, p)
        s = self.initial_state(e, rng, init_scale)
        if adaptive is not None:
            s, logits, steps_used = self._adaptive_steps(e, s, angles, ctx, num_steps, adaptive)
            if last_only:
                logits = common.take_last(logits, ctx.num_new)
            return common.ModelOutput(logits, ctx.finish(), dict(latents=self.ln_f(s), steps_used=steps_used))
        for step in range(num_steps):
            s = self.adapter(jnp.concatenate([s, e], axis=-1))
            for j, block in enumerate(self.core_block):
                s = block(s, angles, ctx, "looped", step, j)
        logits = self.predict_from_latents(s, angles, ctx, ctx.num_new if last_only else None)
        return common.ModelOutput(logits, ctx.finish(), dict(latents=self.ln_f(s)))

    def predict_from_latents(self, s: Float[Array, "b t e"], angles, ctx,
                             last_of: Int[Array, "b"] | None = None) -> Float[Array, "b t v"]:
        """Logits [B, T, V] float32 from core states [B, T, E]: ln_f → coda → ln_f → head.

        With `last_of` (tokens per row), only each row's last real token goes through the head: [B, V].
        """
        x = self.ln_f(s)
        for i, block in enumerate(self.coda):
            x = block(x, angles, ctx, "plain", 0, self.config.num_prelude + i)
        return self.head(x if last_of is None else common.take_last(x, last_of))

    def _adaptive_steps(self, e: Float[Array, "b t e"], s: Float[Array, "b t e"], angles, ctx: CallContext,
                        num_steps: int, rule: AdaptiveExit):
        """The core recurrence with per-token exit: final states [B, T, E] (frozen at exit), logits
        [B, T, V] of each token's exit step (else the last), and steps used [B, T] int32."""
        view = _FrozenKV(ctx)
        bt = e.shape[:2]
        exited, steps_used = jnp.zeros(bt, bool), jnp.zeros(bt, jnp.int32)
        vocab = self.config.vocab_size
        tracker = _ExitTracker(jnp.full((*bt, vocab), -math.log(vocab), jnp.float32), jnp.full(bt, 100.0),
                               jnp.full(bt, -1, jnp.int32), jnp.zeros(bt, jnp.int32))
        logits = None
        for step in range(num_steps):
            view.exited = exited if step else None
            s_new = self.adapter(jnp.concatenate([s, e], axis=-1))
            for j, block in enumerate(self.core_block):
                s_new = block(s_new, angles, view, "looped", step, j)
            step_logits = self.predict_from_latents(s_new, angles, view)
            keep = exited[..., None]
            logits = step_logits if logits is None else jnp.where(keep, logits, step_logits)
            steps_used = steps_used + (~exited).astype(jnp.int32)
            if step < num_steps - 1:  # an exit after the last step changes nothing
                fires, tracker = _exit_fires(rule, tracker, step_logits, s, s_new)
                exited = exited | fires
            s = jnp.where(keep, s, s_new)
        return s, logits, steps_used
