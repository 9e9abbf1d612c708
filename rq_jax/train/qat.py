"""The quantization-aware forward: teacher-forced, every read of past K/V through a cache format's
fake quantization (straight-through gradients), the in-flight tokens exact — as packed-cache inference.

What inference computes. The Sampler and `rq_jax.scoring.CacheScorer` prefill a prompt in one
call (its tokens read each other's K/V exactly, in flight), then feed every later token in a call of
its own: at loop r it reads each earlier token's loop-r K/V as the cache stores them (`write` then
`reconstruct`; for `residual`, against that token's own anchor loop) and its own K/V exactly. The K/V
a token stores were computed in its own call, so they depend on the compressed past before it. With
`calls[b, t]` the call that feeds token t, the stored K/V are the fixed point KV* = F(KV*) of

    F(KV)[t] = the K/V of token t when it reads tokens of earlier calls as fq(KV) and the tokens of
               its own call exactly

(fq = the format's write + reconstruct with straight-through gradients, `LoopQuant.fake_quant`).
Token t's K/V depend on earlier calls only, so the fixed point is reached in as many passes as calls.

What `fake_quant_forward` runs:

    pass 0   every token in one call: the dense teacher-forced forward          → KV_0, dense logits
    pass j   earlier calls read as fq(KV_{j-1}), the token's own call exactly   → KV_j, logits

Pass 0's K/V are exact for call 0 (the prompt, which inference prefills densely), and pass j's for
calls 0..j. So the logits of the last pass `passes` equal token-by-token decoding through the packed
cache at every token of calls 0..passes (the prompt and the first `passes` fed tokens), up to float
rounding (packed attention scores in the rotated basis; a quantizer input one ulp off can flip a
code), and `passes ≥ max(calls)` is exact everywhere (tests/test_qat.py pins both against
`CacheScorer`). Later tokens read past K/V computed from a less compressed past than inference's: a
first-order difference, not a negligible one, which each pass shrinks. Mean KL(packed ‖ forward) over
28 fed tokens after a 12-token prefill, residual INT2 [2,2,2,2]:

    model                                  dense    1 pass   2        4        8        28 (exact)
    ouro-tiny fixture, random tokens       0.0189   0.0163   0.0095   0.0050   0.0017   1e-9
    huginn-tiny fixture, random tokens     0.0204   0.0087   0.0048   0.0025   0.0013   0
    ouro-small's config, untrained        0.0013   0.0012   0.0005   0.0001   0.00004  1e-9
    tiny Ouro after 354 steps, stdlib      0.0057   0.0032   0.0027   0.0009   0.0003   0
      the same, uniform INT2               0.0121   0.0033   0.0022   0.0009   5e-9     5e-9
    tiny Huginn after ~280 steps, 8 loops  0.0121   0.0089   0.0036   0.0017   0.0013   0.0002

(uniform INT2 is exact after 8 passes: once the past's K/V sit inside their quantization cells,
further passes change no code. The last Huginn figure is float rounding amplified by code flips: a
one-ulp change of the embedding moves packed decoding itself by as much.) Training defaults to
`passes=1` (two forwards): every past read quantized exactly as inference quantizes it, the past's
own K/V one pass behind; `QATConfig.passes` buys more.

How the model runs it: a `TeacherForced` value is passed as the model's `context` (a
`rq_jax.cache.context.ContextSource`); its `TeacherForcedContext` implements the `CallContext`
protocol: `attend` merges the stored past (visible to later calls) with the in-flight K/V (same call,
causal) through the same `attend_with_past` as a cache's context, and `finish` leaves no cache but the
pass's K/V (`PassKV`) in the output's extras as "pass_kv".

Shapes: B batch · T tokens · L loops · N layers · K kv heads · D head dim · V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib, default_calib
from rq_jax.cache.context import attend_with_past, causal_mask
from rq_jax.cache.kv import KV, init_cache
from rq_jax.config import ModelConfig
from rq_jax.nn import common
from rq_jax.shapes import Attended, CallMask, NewKV, NumNew, Positions, Queries, Tokens


class PassKV(NamedTuple):
    """The K/V one pass computed, full precision: `looped` K and V [L, N, B, K, T, D]; `plain` (Huginn's
    prelude layers, then coda) [1, N_plain, B, K, T, D] each, or None."""

    looped: KV
    plain: KV | None


class TeacherForcedContext(NamedTuple):
    """One teacher-forced pass's view of the stored K/V (a `rq_jax.cache.context.CallContext`).

    `self_mask` [B, T, T]: key s is in flight for query t (same call, s ≤ t, s real); `past_mask`
    [B, T, T]: key s is read from `stored` (an earlier call). Loops run one per scan step.
    """

    stored: PassKV | None
    num_new: NumNew
    self_mask: CallMask
    past_mask: CallMask
    positions: Positions

    def segments(self, group, num_loops: int) -> tuple[base.Segment, ...]:
        """One loop per group, so a looped slot's (group, layer) index is (loop, layer)."""
        return base.segments(num_loops, 1)

    def attend(self, group, seg: int, index: base.Index, loop: int, q: Queries,
               k: NewKV, v: NewKV, skipped: None = None) -> Attended:
        """Attention of q over the stored K/V of earlier calls and this pass's own K/V (k, v) of the
        same call, merged exactly (as a cache's context; no adaptive exit, so nothing `skipped`)."""
        _no_adaptive_exit(skipped)
        past = None
        if self.stored is not None:
            part = self.stored.looped if group == "looped" else self.stored.plain
            g, layer = index  # one loop per group: the looped slots' group is the loop (plain: 0)
            sk, sv = (x[g + loop, layer] for x in part)  # [B, K, T, D]
            past = base.dense_partial(q, sk, sv, self.past_mask)
        return attend_with_past(q, k, v, self.self_mask, past)

    def finish(self, looped: tuple[tuple[KV, ...], ...], plain: KV | None,
               steps_used: None = None) -> tuple[None, dict[str, PassKV]]:
        """No cache; the pass's K/V as extras["pass_kv"]: looped [L, N, B, K, T, D] from per-segment,
        per-position [G, N, B, K, T, D], plain [1, N_plain, B, K, T, D] from [1, 1, N_plain, B, K, T, D]."""
        _no_adaptive_exit(steps_used)
        return None, {"pass_kv": PassKV(common.flatten_loops(looped),
                                        None if plain is None else tuple(x[0] for x in plain))}


def _no_adaptive_exit(value) -> None:
    if value is not None:
        raise ValueError("teacher-forced passes run every loop: Huginn's adaptive exit is not supported here")


class TeacherForced(NamedTuple):
    """What a teacher-forced pass reads, passed as the model's `context` (a `ContextSource`).

    `calls` [B, T] int32, non-decreasing along t: the call that feeds token t (tokens of one call read
    each other in flight). `stored`: every token's K/V as the cache would return them (already fake-
    quantized), read by tokens of later calls; None in pass 0.
    """

    calls: Int[Array, "b t"]
    stored: PassKV | None = None

    def call_context(self, num_new: NumNew, num_tokens: int, num_loops: int) -> TeacherForcedContext:
        """The context the model's `common.start_call` builds for a call on this past."""
        if self.calls.shape[1] != num_tokens:
            raise ValueError(f"calls cover {self.calls.shape[1]} tokens, the model was given {num_tokens}")
        if self.stored is not None and self.stored.looped[0].shape[0] != num_loops:
            raise ValueError(f"the stored K/V hold {self.stored.looped[0].shape[0]} loops, this call runs {num_loops}")
        c = self.calls
        self_mask = (c[:, :, None] == c[:, None, :]) & causal_mask(num_new, num_tokens)
        past_mask = c[:, None, :] < c[:, :, None]
        positions = jnp.broadcast_to(jnp.arange(num_tokens)[None, :], c.shape)
        return TeacherForcedContext(self.stored, num_new, self_mask, past_mask, positions)


def decode_calls(prefix: Int[Array, "b"], num_tokens: int) -> Int[Array, "b t"]:
    """The calls of token-by-token decoding after a prefill of prefix[b] ≥ 1 tokens: call 0 holds
    tokens t < prefix[b], then every token its own call (t − prefix[b] + 1)."""
    t = jnp.arange(num_tokens)[None, :]
    return jnp.maximum(t - jnp.asarray(prefix, jnp.int32)[:, None] + 1, 0).astype(jnp.int32)


def supports_fake_quant(fmt: base.CacheFormat) -> bool:
    """Whether `fake_quant_forward` can read through `fmt`: its `fake_quant` is implemented (dense's
    dtype cast; the `LoopQuant` family: uniform, rotated, residual), checked on abstract shapes."""
    seg = base.Segment(0, 1, fmt.group_len)
    x = jax.ShapeDtypeStruct((1, fmt.group_len, 1, 1, 1, 1, 64), jnp.float32)
    calib = jax.eval_shape(lambda: fmt.default_calib(seg, 1, 1, 64)) if not fmt.needs_data else None
    try:
        jax.eval_shape(fmt.fake_quant, x, x, calib)
    except NotImplementedError:
        return False
    return True


def fake_quant_kv(kv: PassKV, fmt: base.CacheFormat, calib: CacheCalib,
                  plain_fmt: base.CacheFormat | None = None) -> PassKV:
    """A pass's K/V as the cache stores and reconstructs them: looped layers through `fmt`, plain
    (prelude/coda) layers through `plain_fmt` (default `fmt`, as `init_cache`), straight-through
    gradients to the K/V (`base.fake_quant_loops`). Raises NotImplementedError for a format without
    a fake quantization."""
    plain_fmt = plain_fmt or fmt
    plain = None if kv.plain is None else base.fake_quant_loops(plain_fmt, *kv.plain, calib.plain)
    return PassKV(base.fake_quant_loops(fmt, *kv.looped, calib.looped), plain)


def format_calib(config: ModelConfig, fmt: base.CacheFormat, num_loops: int,
                 plain_fmt: base.CacheFormat | None = None) -> CacheCalib:
    """The formats' data-free calibration (e.g. Hadamard rotations) for a model run with `num_loops`
    loops — the same `CacheScorer` builds when given none."""
    return default_calib(jax.eval_shape(lambda: init_cache(config, 1, 1, fmt, num_loops=num_loops,
                                                           plain_fmt=plain_fmt)))


class QATOutput(NamedTuple):
    """`logits` [B, T, V] of the last pass (reads through the format); `dense_logits` [B, T, V] of pass
    0 (the same model with a dense cache); `kv` the last pass's K/V; `pass_logits` every pass's logits,
    pass 0 first (unused ones cost nothing under jit)."""

    logits: Float[Array, "b t v"]
    dense_logits: Float[Array, "b t v"]
    kv: PassKV
    pass_logits: tuple[Float[Array, "b t v"], ...]


def fake_quant_forward(model, tokens: Tokens, fmt: base.CacheFormat, calib: CacheCalib, *,
                       plain_fmt: base.CacheFormat | None = None, prefix: Int[Array, "b"] | None = None,
                       passes: int = 1, **model_kwargs) -> QATOutput:
    """Teacher-forced logits of `model` on tokens [B, T] with every read of past K/V through `fmt`
    (see the module docstring): prefix[b] tokens prefilled in one call (default 1: every token its own
    call, pure decoding), then `passes` passes each reading the previous pass's K/V fake-quantized.

    `calib`: the formats' calibration (`format_calib`, or `rq_jax.calibrate.load_calibration`).
    `model_kwargs` go to every model call (`num_loops`, Huginn's `rng` and `init_scale`, Ouro's `exit`);
    every pass sees the same ones, so Huginn's random initial state is shared by all passes.
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a positive integer, got {passes!r}")
    b, t = tokens.shape
    prefix = jnp.ones((b,), jnp.int32) if prefix is None else jnp.asarray(prefix, jnp.int32)
    calls = decode_calls(prefix, t)
    out = model(tokens, context=TeacherForced(jnp.zeros_like(calls)), **model_kwargs)
    logits, kv = [out.logits], out.extras["pass_kv"]
    for _ in range(passes):
        out = model(tokens, context=TeacherForced(calls, fake_quant_kv(kv, fmt, calib, plain_fmt)), **model_kwargs)
        logits.append(out.logits)
        kv = out.extras["pass_kv"]
    return QATOutput(logits[-1], logits[0], kv, tuple(logits))
