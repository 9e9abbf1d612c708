"""Precision of a long recurrence: Huginn at 32 core steps on the shared fixture (tests/fixtures/huginn-tiny,
random weights saved by the reference), float32 and float64 (`jax_enable_x64`) against a float64 numpy
transcription of the reference's forward (recpre/raven_modeling_minimal.py, no cache, zero initial state).

A float64 run of rq_jax computes in float64 throughout (norms, RoPE, softmax and logits included), so
it is the exact reference of a float32 run: it agrees with the transcription to the float32 RoPE table
the latter reads (the checkpoint's `freqs_cis`, ~1e-7 from exact). The float32 run's spread from it is
pinned on 16 random prompts, beside that of the transcription run in float32 (numpy's own summation
order): per prompt either may be the closer one (a recurrence amplifies rounding differently for each
order), so the medians are compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.config import from_hf_config
from rq_jax.convert.hf import load_model, read_tensors
from tests.conftest import fixture_dir

STEPS = 32


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
def logits():
    """Logits at 32 steps on 16 random prompts of 10 tokens: rq_jax float32 and float64, the
    transcription in both."""
    folder = fixture_dir("huginn-tiny")
    tensors, config = read_tensors(folder), from_hf_config(folder)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (16, 10))
    out = {"np64": reference_logits(tensors, config, ids, STEPS, np.float64),
           "np32": reference_logits(tensors, config, ids, STEPS, np.float32)}
    model, _ = load_model(folder)
    out["rq32"] = np.asarray(model(jnp.asarray(ids), num_steps=STEPS, init_scale=0.0).logits, np.float64)
    jax.config.update("jax_enable_x64", True)
    try:
        model, _ = load_model(folder, dtype=jnp.float64, param_dtype=jnp.float64)
        result = model(jnp.asarray(ids), num_steps=STEPS, init_scale=0.0).logits
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
