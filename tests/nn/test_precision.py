"""Precision of a long recurrence: Huginn at 32 core steps on the shared fixture (tests/fixtures/huginn-tiny,
random weights saved by the reference), float32 and float64 (`jax_enable_x64`) against a float64 numpy
transcription of the reference's forward (recpre/raven_modeling_minimal.py, no cache, zero initial state).

A float64 run of rq_jax computes in float64 throughout (norms, RoPE, softmax and logits included), so
it is the exact reference of a float32 run: it agrees with the transcription to the float32 RoPE table
the latter reads (the checkpoint's `freqs_cis`, ~1e-7 from exact). The float32 run's spread from it is
pinned on 16 random prompts, beside that of the transcription run in float32 (numpy's own summation
order): per prompt either may be the closer one (a recurrence amplifies rounding differently for each
order), so the medians are compared.

The adaptive path (decode-time KL exit, `latest-m4` lookup) is held to the same spread: a float32 decode
through a float32 dense cache against the same decode in float64, whose past is held exactly
(`ExactPast`: a cache stores float32 at most).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Dense, base
from rq_jax.cache.context import SelfMask, attend_with_past
from rq_jax.cache.kv import KV, KVCache
from rq_jax.config import from_hf_config
from rq_jax.convert.hf import load_model, read_tensors
from rq_jax.nn import common
from rq_jax.nn.huginn import AdaptiveExit, _exit_fires, _ExitTracker
from tests.conftest import fixture_dir

STEPS = 32
#: Decode-time exit (the prompt runs every step): the KL at every step the test checks lies ≥ 2e-4 from
#: 0.025, its float32 error ≤ 8e-6, so no exit decision sits at the threshold.
ADAPTIVE = AdaptiveExit("kl", 0.025, exit_in_prefill=False, lookup="latest-m4")
NEW_TOKENS = 4


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def reference_logits(tensors: dict, config, ids: np.ndarray, steps: int, dtype) -> np.ndarray:
    """The reference forward in `dtype` numpy [B, S, V]: prelude, `steps` of s = core(adapter([s, e]))
    from s = 0, ln_f, coda, ln_f, tied head; sandwich blocks, interleaved RoPE from the stored freqs_cis."""
    def w(name):
        return tensors[name].astype(dtype)

    b, s = ids.shape
    h, d = config.num_heads, config.head_dim
    cos, sin = (tensors["freqs_cis"][0, :s, 0, :, i].astype(dtype) for i in (0, 1))  # [S, D/2]
    causal = np.tril(np.ones((s, s), bool))

    def rope(x):  # [B, S, H, D] on pairs (2i, 2i+1)
        re, im = x[..., 0::2], x[..., 1::2]
        c, n = cos[None, :, None], sin[None, :, None]
        return np.stack([re * c - im * n, im * c + re * n], axis=-1).reshape(x.shape)

    def block(prefix, x):
        eps = config.rms_norm_eps
        q, k, v = np.split(rms_norm(x, w(prefix + "norm_1.weight"), eps) @ w(prefix + "attn.Wqkv.weight").T,
                           [h * d, 2 * h * d], axis=-1)
        bias = w(prefix + "attn.qk_bias")
        q, k, v = rope(q.reshape(b, s, h, d) + bias[0]), rope(k.reshape(b, s, h, d) + bias[1]), v.reshape(b, s, h, d)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / dtype(np.sqrt(d))
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        y = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v).reshape(b, s, h * d)
        x = rms_norm(y @ w(prefix + "attn.proj.weight").T + x, w(prefix + "norm_2.weight"), eps)
        a, g = np.split(rms_norm(x, w(prefix + "norm_3.weight"), eps) @ w(prefix + "mlp.fc.weight").T, 2, axis=-1)
        return rms_norm((a / (1 + np.exp(-a)) * g) @ w(prefix + "mlp.proj.weight").T + x,
                        w(prefix + "norm_4.weight"), eps)

    e = w("transformer.wte.weight")[ids] * dtype(config.embed_scale)
    for i in range(config.num_prelude):
        e = block(f"transformer.prelude.{i}.", e)
    state = np.zeros_like(e)
    for _ in range(steps):
        state = np.concatenate([state, e], axis=-1) @ w("transformer.adapter.weight").T
        for i in range(config.num_layers):
            state = block(f"transformer.core_block.{i}.", state)
    x = rms_norm(state, w("transformer.ln_f.weight"), config.rms_norm_eps)
    for i in range(config.num_coda):
        x = block(f"transformer.coda.{i}.", x)
    x = rms_norm(x, w("transformer.ln_f.weight"), config.rms_norm_eps)
    return (x @ w("transformer.wte.weight").T).astype(np.float64)


@pytest.fixture(scope="module")
def prompts() -> np.ndarray:
    """16 random prompts of 10 tokens [16, 10]."""
    return np.random.default_rng(0).integers(0, from_hf_config(fixture_dir("huginn-tiny")).vocab_size, (16, 10))


@pytest.fixture(scope="module")
def logits(prompts):
    """Logits at 32 steps on the prompts: rq_jax float32 and float64, the transcription in both."""
    folder = fixture_dir("huginn-tiny")
    tensors, config = read_tensors(folder), from_hf_config(folder)
    out = {"np64": reference_logits(tensors, config, prompts, STEPS, np.float64),
           "np32": reference_logits(tensors, config, prompts, STEPS, np.float32)}
    model, _ = load_model(folder)
    out["rq32"] = np.asarray(model(jnp.asarray(prompts), num_steps=STEPS, init_scale=0.0).logits, np.float64)
    jax.config.update("jax_enable_x64", True)
    try:
        model, _ = load_model(folder, dtype=jnp.float64, param_dtype=jnp.float64)
        result = model(jnp.asarray(prompts), num_steps=STEPS, init_scale=0.0).logits
        assert result.dtype == jnp.float64
        out["rq64"] = np.asarray(result)
    finally:
        jax.config.update("jax_enable_x64", False)
    return out


def spread(a, b) -> np.ndarray:
    """max |a − b| per prompt [B]."""
    return np.max(np.abs(a - b), axis=(1, 2))


def test_the_float64_run_is_float64_throughout(logits):
    """3.9e-7 here, the two RoPE tables apart; with its norms, RoPE, softmax and logits in float32
    (before) a float64 run sat 3.8e-5 from float64 at 32 steps, as far as the float32 run itself."""
    assert spread(logits["rq64"], logits["np64"]).max() < 2e-6


def test_float32_spread_at_32_steps(logits):
    """rq_jax float32 against float64: median 7.3e-6 over the prompts (the logits span about ±5), the
    transcription's own float32 run 6.7e-6."""
    ours, theirs = np.median(spread(logits["rq32"], logits["rq64"])), np.median(spread(logits["np32"], logits["np64"]))
    assert ours < 2e-5 and ours < 1.5 * theirs


class ExactContext(NamedTuple):
    """The `CallContext` of an `ExactPast` call: attention over the held positions < `length` merged with
    the call's own K/V; the call's K/V come back as extras["kv"] (looped [L, N, B, K, T, D], plain
    [1, N_plain, B, K, T, D])."""

    past: tuple[KV, KV]
    length: jax.Array
    num_new: jax.Array
    self_mask: SelfMask
    positions: jax.Array

    def segments(self, group, num_loops: int) -> tuple[base.Segment, ...]:
        """One loop per group: a looped slot (g, j) at position 0 is loop g's layer j, as `ExactPast` holds it."""
        return base.segments(num_loops, 1)

    def attend(self, group, seg, index, loop, q, k, v, skipped=None):
        """q [B, T, H, D] over the held K/V of the slot and the call's own k, v [B, K, T, D]."""
        held_k, held_v = (x[index[0] + loop, index[1]] for x in self.past[group == "plain"])
        b, t = q.shape[:2]
        visible = jnp.broadcast_to(jnp.arange(held_k.shape[2]) < self.length, (b, t, held_k.shape[2]))
        return attend_with_past(q, k, v, self.self_mask, base.dense_partial(q, held_k, held_v, visible))

    def finish(self, looped, plain, steps_used=None):
        """No cache; the call's K/V flattened to one loop axis (`common.flatten_loops`)."""
        return None, {"kv": (common.flatten_loops(looped), tuple(x[0] for x in plain))}


class ExactPast(NamedTuple):
    """A past held as the model computed it (a `ContextSource`), in the run's own dtype: looped K/V
    [L, N, B, K, S, D] and plain K/V [1, N_plain, B, K, S, D] of the first `length` positions."""

    past: tuple[KV, KV]
    length: jax.Array

    @classmethod
    def empty(cls, model, batch: int, max_len: int, dtype) -> "ExactPast":
        """No position held yet, room for `max_len` of `batch` rows at STEPS loops."""
        c = model.config
        def zeros(n, layers):
            return (jnp.zeros((n, layers, batch, c.num_kv_heads, max_len, c.head_dim), dtype),) * 2
        return cls((zeros(STEPS, c.num_layers), zeros(1, c.num_prelude + c.num_coda)), jnp.int32(0))

    def call_context(self, num_new, num_tokens: int, num_loops: int) -> ExactContext:
        """The context of a call of `num_tokens` tokens per row, placed after the held ones."""
        positions = jnp.broadcast_to(self.length + jnp.arange(num_tokens), (num_new.shape[0], num_tokens))
        return ExactContext(self.past, self.length, num_new, SelfMask(num_new), positions)

    def extend(self, kv, num_tokens: int) -> "ExactPast":
        """This past with a call's K/V (its extras["kv"]) at positions length .. length + num_tokens − 1."""
        past = jax.tree_util.tree_map(lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new, self.length, 4),
                                      self.past, kv)
        return ExactPast(past, self.length + num_tokens)


def adaptive_decode(model, ids: np.ndarray, past: KVCache | ExactPast) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefill ids [B, S] at every step, then NEW_TOKENS greedy decode calls with ADAPTIVE, reading the
    past from a cache or an `ExactPast`. Returns the decode tokens' logits [B, N, V], their steps [B, N]
    and the tokens fed [B, N]."""
    def call(tokens, past, **kw):
        if isinstance(past, KVCache):
            out = model(tokens, past, num_steps=STEPS, init_scale=0.0, last_only=True, **kw)
            return out, out.cache
        out = model(tokens, num_steps=STEPS, init_scale=0.0, last_only=True, context=past, **kw)
        return out, past.extend(out.extras["kv"], tokens.shape[1])

    out, past = call(jnp.asarray(ids), past)
    logits, steps, fed = [], [], []
    for _ in range(NEW_TOKENS):
        fed.append(np.asarray(jnp.argmax(out.logits, -1)))
        out, past = call(jnp.asarray(fed[-1], jnp.int32)[:, None], past, adaptive=ADAPTIVE)
        logits.append(np.asarray(out.logits))
        steps.append(np.asarray(out.extras["steps_used"])[:, 0])
    return np.stack(logits, 1), np.stack(steps, 1), np.stack(fed, 1)


def test_adaptive_decode_spread_at_32_steps(prompts, logits):
    """64 decode tokens (16 prompts × 4; 72% exit, after 7 to 28 steps): float32 through a float32 dense
    cache against float64 throughout, per token max |Δ| median 3.7e-6, worst 1.6e-5 (an AVX-512 host; 4.2e-6
    and 3.2e-5 where XLA:CPU emits AVX2 code, an EPYC without AVX-512) — the transcription's own float32
    spread at 32 steps (median 6.7e-6, worst 1.6e-5 over the prompts) — with the same tokens and steps.
    The float64 adaptive run failed before: its criterion state and kept logits were float32 carries of a
    float64 loop."""
    folder = fixture_dir("huginn-tiny")
    model, _ = load_model(folder)
    max_len = prompts.shape[1] + NEW_TOKENS
    ours = adaptive_decode(model, prompts, model.init_cache(len(prompts), max_len, Dense("float32"), num_loops=STEPS))
    jax.config.update("jax_enable_x64", True)
    try:
        model, _ = load_model(folder, dtype=jnp.float64, param_dtype=jnp.float64)
        exact = adaptive_decode(model, prompts, ExactPast.empty(model, len(prompts), max_len, jnp.float64))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert exact[0].dtype == np.float64
    np.testing.assert_array_equal(exact[2], ours[2])
    np.testing.assert_array_equal(exact[1], ours[1])
    assert 0.5 < (ours[1] < STEPS).mean() < 1
    per_token = np.max(np.abs(ours[0] - exact[0]), axis=-1)  # [B, N]
    theirs = spread(logits["np32"], logits["np64"])
    assert np.median(per_token) < 1.5 * np.median(theirs) and per_token.max() < 6 * np.median(theirs)


def test_latent_diff_of_a_float64_state_is_float64():
    """A relative change of 1e-12 (below float32's resolution) is seen in a float64 run: the criterion
    no longer rounds the states to float32 first (which made it 0 and fire at threshold 1e-13)."""
    jax.config.update("jax_enable_x64", True)
    try:
        s = jnp.linspace(1.0, 2.0, 8, dtype=jnp.float64).reshape(1, 1, 8)
        tracker = _ExitTracker(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1)), jnp.zeros((1, 1), jnp.int32),
                               jnp.zeros((1, 1), jnp.int32))
        for num_new in (None, jnp.array([1])):  # per token, and per row
            logits = tracker.log_probs  # not read by latent-diff
            fires, _ = _exit_fires(AdaptiveExit("latent-diff", 1e-13), tracker, logits, s, s * (1 + 1e-12), num_new)
            assert not bool(fires[0, 0])
    finally:
        jax.config.update("jax_enable_x64", False)
