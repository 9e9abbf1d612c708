"""Huginn-0125 ("recurrent depth"): prelude, a core block recurring `num_steps` times, coda.

    e = wte(ids) * embed_scale;  e = prelude(e)
    s = initial_state                               # zeros, or seeded truncated normal
    for step in range(num_steps): s = core(adapter(concat([s, e])))
    latent = ln_f(s);  logits = head(ln_f(coda(latent)))      # the same ln_f twice

Sandwich blocks norm the residual sum: x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x))).
Cache slots: core step t, block j → looped slot (t, j); prelude p → plain slot p; coda c → plain
slot num_prelude + c. The loop count is `num_loops` as in Ouro; `num_steps`, the reference's name, is
accepted as an alias.

Adaptive compute (`AdaptiveExit`): a call's tokens stop their recurrence once a convergence criterion
fires — by default all tokens of a row together, on the criterion of its last token, as the reference's
`generate_with_adaptive_compute` does (also for the prompt). Their skipped steps are hidden from later
tokens — the reference's default ("full") cache lookup, in a cache built with `track_steps=True` —
or, with `lookup="latest-m4"`, read as their last computed step's K/V, which every later slot of the
token holds either way (so the cache stays complete for every format).

Random initial state: token t of batch row b draws its noise from `fold_in(fold_in(rng, b), t)`, so a
row's state depends on the key, its batch position and its own tokens only — never on its batch-mates
or the batch's padded length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rq_jax.cache.context import CallContext, ContextSource
from rq_jax.cache.kv import KV, KVCache
from rq_jax.config import ModelConfig
from rq_jax.nn import common
from rq_jax.nn.layers import RMSNorm, linear, rope_interleaved, rope_table, wide
from rq_jax.shapes import NumNew, Tokens


#: The reference's default ("auto") threshold of each criterion (seal-rg/recurrent-pretraining
#: `raven_modeling_minimal.py`; older commits and the paper used 5e-4 for "kl").
DEFAULT_THRESHOLDS = {"kl": 1e-3, "entropy-diff": 1e-3, "latent-diff": 0.03, "argmax-stability": 5}
#: What later tokens read at a step an earlier token skipped (the reference's lookup strategy names).
LOOKUPS = ("full", "latest-m4")


@dataclasses.dataclass(frozen=True)
class AdaptiveExit:
    """Early exit of the core recurrence (the reference's `generate_with_adaptive_compute`).

    After every core step the criterion compares the step with the previous one and the tokens exit
    when it fires (an exit after step i uses i + 1 steps):
      "kl": KL(previous next-token distribution ‖ current) < threshold; the distribution before the
          first step is uniform over the vocabulary (default 1e-3, the reference's current one).
      "entropy-diff": |entropy − previous entropy| < threshold, previous entropy 100 at first
          (default 1e-3).
      "latent-diff": ‖s_prev − s‖ / ‖s‖ < threshold for the latent state s, s_prev the state before
          the step (default 0.03).
      "argmax-stability": the argmax of the logits unchanged for ≥ int(threshold) consecutive steps,
          the threshold truncated to an integer as the reference does (default 5).
    `threshold` None takes the criterion's default.

    `exit_in_prefill` (default True, the reference's default `do_not_exit_in_prefill=False`): a model
    call decides per row — all of a row's tokens in the call exit together, on the criterion of its
    last token (latent-diff: averaged over its tokens), as the reference's evaluators (`reduce=True`)
    do — and the Sampler applies the rule to the prompt too, so the whole prompt exits jointly and the
    first generated token uses that many steps. False (the reference's `do_not_exit_in_prefill=True`):
    the Sampler's prefill runs every step, and in a model call every token exits on its own criterion.
    Decode calls (one token per row) behave the same either way. The default follows the reference so
    that adaptive generation is the reference's out of the box; False keeps the prompt's K/V of every
    step (no frozen copies), which later tokens read.

    `lookup`: what later tokens see at a step an earlier token skipped. "full" (the reference's default
    `cache_lookup_strategy`): nothing — the token is absent from that step's attention; the cache
    must track steps (`init_cache(..., track_steps=True)`, which the Sampler builds) and attention to
    its past runs through the format's `reconstruct` under that mask, not the fused paths. "latest-m4":
    the token's last computed step, which its skipped slots hold; any cache, every fast path. Raises
    ValueError for an unknown criterion or lookup, or a non-finite threshold.

    Each row stops at its own exit: the reference at batch size 1, the only size at which its docstring
    has adaptive compute measured. Its batched loop runs until the batch's last row exits, so there a
    row that exited earlier goes on computing, and its later tokens read those steps' K/V and the
    coda's of the batch's last step (re-stated on a random 2/4/2 Huginn at 32 steps, 4 rows: logits
    4e-3 to 1e-1 from these, the same tokens and steps).
    """

    criterion: str = "kl"
    threshold: float | None = None
    exit_in_prefill: bool = True
    lookup: str = "full"

    def __post_init__(self):
        if self.criterion not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown adaptive-exit criterion {self.criterion!r}: expected one of "
                             f"{', '.join(repr(c) for c in DEFAULT_THRESHOLDS)}")
        if self.threshold is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLDS[self.criterion])
        if not math.isfinite(self.threshold):
            raise ValueError(f"adaptive-exit threshold must be finite, got {self.threshold}")
        if not isinstance(self.exit_in_prefill, bool):
            raise ValueError(f"exit_in_prefill must be True or False, got {self.exit_in_prefill!r}")
        if self.lookup not in LOOKUPS:
            raise ValueError(f"unknown cache lookup {self.lookup!r}: expected one of {LOOKUPS}")

    def check_cache(self, cache: KVCache | None) -> None:
        """Raise ValueError unless `cache` (None: no cache) suits the lookup: one that tracks steps for
        "full", one that does not for "latest-m4"."""
        if cache is None or not isinstance(cache, KVCache) or (cache.steps is not None) == (self.lookup == "full"):
            return
        if self.lookup == "full":
            raise ValueError('adaptive exit with lookup="full" hides skipped steps and needs a cache built with '
                             'init_cache(..., track_steps=True) (or AdaptiveExit(lookup="latest-m4"))')
        raise ValueError('adaptive exit with lookup="latest-m4" needs a cache without track_steps '
                         '(a cache that tracks steps hides skipped steps: lookup="full")')


class _ExitTracker(NamedTuple):
    """Criterion state per decision, [B, T] per token or [B, 1] per row (log_probs [B, T or 1, V])."""

    log_probs: Float[Array, "b t v"]
    entropy: Float[Array, "b t"]
    argmax: Int[Array, "b t"]
    stable: Int[Array, "b t"]


def _exit_fires(rule: AdaptiveExit, tracker: _ExitTracker, logits: Float[Array, "b t v"],
                s_prev: Float[Array, "b t e"], s: Float[Array, "b t e"],
                num_new: NumNew | None = None) -> tuple[Bool[Array, "b #t"], _ExitTracker]:
    """Whether the criterion fires after this step, and the updated criterion state: per token [B, T],
    or with `num_new` (each row's real tokens) per row [B, 1] — logits criteria on the row's last real
    token, latent-diff averaged over its real tokens (the reference's `reduce=True`)."""
    if num_new is not None:
        if rule.criterion != "latent-diff":
            logits = common.take_last(logits, num_new)[:, None]
        else:
            value = _latent_change(s_prev, s)
            real = jnp.arange(s.shape[1])[None, :] < num_new[:, None]
            value = jnp.sum(jnp.where(real, value, 0.0), axis=1) / jnp.maximum(num_new, 1)
            return (value < rule.threshold)[:, None], tracker
    if rule.criterion == "kl":
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        value = jnp.sum(jnp.exp(tracker.log_probs) * (tracker.log_probs - log_probs), axis=-1)
        return value < rule.threshold, tracker._replace(log_probs=log_probs)
    if rule.criterion == "entropy-diff":
        probs = jax.nn.softmax(logits, axis=-1)
        entropy = -jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
        return jnp.abs(entropy - tracker.entropy) < rule.threshold, tracker._replace(entropy=entropy)
    if rule.criterion == "latent-diff":
        return _latent_change(s_prev, s) < rule.threshold, tracker
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    stable = jnp.where(argmax == tracker.argmax, tracker.stable + 1, 0)
    return stable >= int(rule.threshold), tracker._replace(argmax=argmax, stable=stable)


def _latent_change(s_prev: Float[Array, "b t e"], s: Float[Array, "b t e"]) -> Float[Array, "b t"]:
    """‖s_prev − s‖ / ‖s‖ per token, in float32 (float64 for a float64 state)."""
    s_prev, s = s_prev.astype(wide(s.dtype)), s.astype(wide(s.dtype))
    return jnp.linalg.norm(s_prev - s, axis=-1) / jnp.linalg.norm(s, axis=-1)


def _frozen(attend: common.Attend, exited: Bool[Array, "b t"], prev: KV) -> common.Attend:
    """`attend` with exited tokens' K/V replaced by `prev` ([B, K, T, D] each, their K/V of the previous
    step: by induction their last computed step, the reference's `latest-m4`), for storage and the
    other tokens' attention — which hides them instead in a cache that tracks steps."""
    def call(q, k, v):
        frozen = exited[:, None, :, None]
        return attend(q, jnp.where(frozen, prev[0], k), jnp.where(frozen, prev[1], v), skipped=exited)

    return call


class HuginnAttention(nnx.Module):
    """Fused Wqkv (rows q|k|v), per-head q/k bias before interleaved RoPE."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.init_std)
        self.Wqkv = linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, **kw)
        self.qk_bias = nnx.Param(jnp.zeros((2, 1, c.num_heads, c.head_dim), param_dtype)) if c.qk_bias else None
        self.proj = linear(c.hidden_size, c.hidden_size, **kw)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, x, rope, attend: common.Attend):
        """x [B, T, E] → (output [B, T, E], the stored K/V [B, K, T, D] each)."""
        h, k, d = self.shape
        bt = x.shape[:2]
        q, key, value = jnp.split(self.Wqkv(x), [h * d, (h + k) * d], axis=-1)
        q, key, value = q.reshape(*bt, h, d), key.reshape(*bt, k, d), value.reshape(*bt, k, d)
        if self.qk_bias is not None:
            bias = self.qk_bias[...].astype(x.dtype)
            q, key = q + bias[0], key + bias[1]
        q, key = rope_interleaved(q, rope), rope_interleaved(key, rope)
        o, kv = attend(q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3))
        return self.proj(o.reshape(*bt, h * d)), kv


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
        def norm():
            return RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)

        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = norm(), norm(), norm(), norm()
        self.attn = HuginnAttention(c, **kw)
        self.mlp = HuginnMLP(c, **kw)

    def __call__(self, x, rope, attend: common.Attend):
        """x [B, T, E] → (x [B, T, E], the stored K/V)."""
        a, kv = self.attn(self.norm_1(x), rope, attend)
        x = self.norm_2(x + a)
        return self.norm_4(x + self.mlp(self.norm_3(x))), kv


class Huginn(common.LoopedModule):
    """Huginn causal LM. Call it with tokens [B, T] and an optional cache; see `__call__`."""

    stacks = ("prelude", "core_block", "coda")

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if config.family != "huginn":
            raise ValueError(f"Huginn needs a 'huginn' config, got family {config.family!r}")
        c = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wte, self.lm_head = common.embedding_and_head(c, **kw)
        self.prelude = common.stacked(lambda: SandwichBlock(c, **kw), c.num_prelude)
        self.adapter = linear(2 * c.hidden_size, c.hidden_size, std=c.init_std, **kw)
        self.core_block = common.stacked(lambda: SandwichBlock(c, **kw), c.num_layers)
        self.coda = common.stacked(lambda: SandwichBlock(c, **kw), c.num_coda)
        self.ln_f = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """ln_f then the (tied) output projection, logits in float32."""
        return common.output_logits(self.wte, self.lm_head, self.ln_f(x))

    def initial_state(self, embeds: Float[Array, "b t e"], rng: jax.Array | None, init_scale: float):
        """Zeros when `rng` is None or `init_scale` is 0, else a ±3σ truncated normal of σ = std·scale,
        times the embedding scale (the reference's `initialize_state`). Token t of row b draws from
        `fold_in(fold_in(rng, b), t)`: the same batch position gets the same noise whatever its
        batch-mates and the batch's padded length. `rng` may also hold one key per row [B] (a serving
        engine's slots): row b then draws as row 0 of its own batch, `fold_in(fold_in(rng[b], 0), t)`."""
        if rng is None or init_scale == 0:
            return jnp.zeros_like(embeds)
        b, t, e = embeds.shape
        if jnp.ndim(rng):
            rows = jax.vmap(lambda key: jax.random.fold_in(key, 0))(rng)
        else:
            rows = jax.vmap(lambda row: jax.random.fold_in(rng, row))(jnp.arange(b))

        def token(row_key, pos):
            key = jax.random.fold_in(row_key, pos)
            return jax.random.truncated_normal(key, -3.0, 3.0, (e,), jnp.float32)

        noise = jax.vmap(jax.vmap(token, (None, 0)), (0, None))(rows, jnp.arange(t))
        std = self.config.init_std * init_scale
        return (noise * std * self.config.embed_scale).astype(embeds.dtype)

    def __call__(self, tokens: Tokens, cache: KVCache | None = None, *,
                 num_new: NumNew | None = None, num_loops: int | None = None,
                 num_steps: int | None = None, rng: jax.Array | None = None, init_scale: float = 1.0,
                 last_only: bool = False, calib: Any = None, adaptive: AdaptiveExit | None = None,
                 context: ContextSource | None = None) -> common.ModelOutput:
        """Run `num_loops` core steps (default the config's mean recurrence) over tokens [B, T].

        `num_steps` is the reference's name for `num_loops` (give one). The initial latent state is
        zeros unless `rng` is given (one key, or one per row [B]; then per row and token, see
        `initial_state`). With a cache, token t of row b sits at position cache.lengths[b] + t and the
        first num_new[b] tokens are written. Returns logits [B, T, V] ([B, V] with
        `last_only`), the new cache, and extras `latents` [B, T, E] (ln_f of the final state, the
        coda's input).

        With `adaptive`, tokens stop at the step where the criterion fires (see `AdaptiveExit`): their
        state, logits and K/V stay those of that step, their later looped slots hold their last
        computed step's K/V, and extras add `steps_used` [B, T] int32 (core steps each token computed,
        1..num_loops). With `exit_in_prefill` (the default) a row's tokens exit together on its last
        token's criterion — a prompt exits jointly, as in the reference's default; without it each
        token exits on its own criterion, which at step i sees the call's other tokens at step i (or
        frozen at their exit). All steps still run for the batch (static shapes) and the coda and head
        run after every step to evaluate the criterion.

        `context` reads the past from something other than a cache (`rq_jax.cache.context`).
        """
        if num_steps is not None and num_loops is not None and num_steps != num_loops:
            raise ValueError(f"num_steps ({num_steps}) is an alias of num_loops ({num_loops}): give one")
        num_loops = next((n for n in (num_loops, num_steps) if n is not None), self.config.num_loops)
        return common.run(self, tokens, cache, dict(num_new=num_new, calib=calib, rng=rng, context=context),
                          dict(num_loops=num_loops, init_scale=init_scale, last_only=last_only, adaptive=adaptive))

    def _forward(self, tokens, cache, *, num_new, num_loops, rng, init_scale, last_only, calib,
                 adaptive, context) -> common.ModelOutput:
        c = self.config
        ctx = common.start_call(tokens, cache, num_new, num_loops, calib, context)
        rope = rope_table(ctx.positions, c.head_dim, c.rope_theta, self.wte.dtype)
        e = self.wte(tokens) * jnp.asarray(c.embed_scale, self.wte.dtype)
        prelude_kv = None
        if self.prelude is not None:
            e, prelude_kv = self._plain(self.prelude, 0, e, rope, ctx)
        s = self.initial_state(e, rng, init_scale)
        segments = ctx.segments("looped", num_loops)
        steps_used = None
        if adaptive is not None:
            adaptive.check_cache(cache)
            s, logits, steps_used, looped_kv, coda_kv = self._adaptive(e, s, rope, ctx, segments, adaptive)
            extras = dict(latents=self.ln_f(s), steps_used=steps_used)
        else:
            def step(s, seg, g, r):
                return self._core(s, e, rope, ctx, seg, g, r)

            s, looped_kv = common.run_loops(segments, s, step)
            x, coda_kv = self._coda(s, rope, ctx)
            logits = self.head(common.take_last(x, ctx.num_new) if last_only else x)
            extras = dict(latents=self.ln_f(s))
        if last_only and adaptive is not None:
            logits = common.take_last(logits, ctx.num_new)
        plain_kv = [kv for kv in (prelude_kv, coda_kv) if kv is not None]
        plain_kv = tuple(jnp.concatenate(x)[None, None] for x in zip(*plain_kv)) if plain_kv else None
        new_cache, left = ctx.finish(looped_kv, plain_kv, steps_used)
        return common.ModelOutput(logits, new_cache, {**extras, **left})

    def _plain(self, blocks: nnx.Module, first: int, x, rope, ctx: CallContext, frozen=None):
        """x through prelude or coda blocks (plain slots `first` + i): (x, K/V [N, B, K, T, D] each).
        `frozen` = (exited [B, T], previous K/V [N, B, K, T, D] each) holds exited tokens' K/V."""
        def block(module, i, x, prev):
            attend = common.slot_attend(ctx, "plain", 0, (0, first + i), 0)
            return module(x, rope, attend if frozen is None else _frozen(attend, frozen[0], prev))

        return common.scan_layers(blocks, x, block, None if frozen is None else frozen[1])

    def _core(self, s, e, rope, ctx: CallContext, seg: int, g, r: int, frozen=None):
        """One recurrence step from state s: adapter, then the core blocks (looped slots of segment
        `seg`, group g, position r). Returns the new state and the K/V [N, B, K, T, D] each."""
        s = self.adapter(jnp.concatenate([s, e], axis=-1))

        def block(module, i, s, prev):
            attend = common.slot_attend(ctx, "looped", seg, (g, i), r)
            return module(s, rope, attend if frozen is None else _frozen(attend, frozen[0], prev))

        return common.scan_layers(self.core_block, s, block, None if frozen is None else frozen[1])

    def _coda(self, s, rope, ctx: CallContext, frozen=None):
        """ln_f then the coda blocks: the head's input [B, T, E] and the coda's K/V (None without coda)."""
        x = self.ln_f(s)
        if self.coda is None:
            return x, None
        return self._plain(self.coda, self.config.num_prelude, x, rope, ctx, frozen)

    def _adaptive(self, e, s, rope, ctx: CallContext, segments, rule: AdaptiveExit):
        """The core recurrence with early exit (per row, or per token without `exit_in_prefill`): final
        states [B, T, E] (frozen at exit), logits [B, T, V] of each token's exit step (else the last),
        steps used [B, T] int32, the looped K/V per segment and the coda's K/V."""
        c = self.config
        b, t = e.shape[:2]
        vocab = c.vocab_size
        joint = ctx.num_new if rule.exit_in_prefill else None  # decide per row, on its last token
        d = 1 if rule.exit_in_prefill else t  # decisions per row
        def kv_zeros(n):
            return (jnp.zeros((n, b, c.num_kv_heads, t, c.head_dim), e.dtype),) * 2
        acc = wide(e.dtype)  # the logits' dtype: float64 in a float64 run
        tracker = _ExitTracker(jnp.full((b, d, vocab), -math.log(vocab), acc), jnp.full((b, d), 100.0, acc),
                               jnp.full((b, d), -1, jnp.int32), jnp.zeros((b, d), jnp.int32))
        carry = (s, jnp.zeros((b, t), bool), jnp.zeros((b, t), jnp.int32), tracker,
                 jnp.zeros((b, t, vocab), acc), kv_zeros(c.num_layers), kv_zeros(c.num_coda))

        def step(carry, seg, g, r):
            s, exited, steps_used, tracker, logits, core_kv, coda_kv = carry
            s_new, core_kv = self._core(s, e, rope, ctx, seg, g, r, frozen=(exited, core_kv))
            x, new_coda = self._coda(s_new, rope, ctx, frozen=(exited, coda_kv))
            step_logits = self.head(x)
            keep = exited[..., None]
            logits = jnp.where(keep, logits, step_logits)
            steps_used = steps_used + (~exited).astype(jnp.int32)
            fires, tracker = _exit_fires(rule, tracker, step_logits, s, s_new, joint)  # after the last step: unused
            s = jnp.where(keep, s, s_new)
            coda_kv = coda_kv if new_coda is None else new_coda
            return (s, exited | jnp.broadcast_to(fires, exited.shape), steps_used, tracker, logits, core_kv,
                    coda_kv), core_kv

        carry, looped_kv = common.run_loops(segments, carry, step)
        s, _, steps_used, _, logits, _, coda_kv = carry
        return s, logits, steps_used, looped_kv, (coda_kv if self.coda is not None else None)
