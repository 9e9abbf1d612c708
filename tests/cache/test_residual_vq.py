"""The `residual_vq` cache format: LUT attention, RVQ vs 2-bit uniform error, padding-free calibration,
storage accounting, the missing-calibration error, and generation with the fixture models.

Measured (seed 0, student-t ν=3 keys with per-channel magnitudes, [2 slots, 64 tokens, 2 heads, 16]):
relative MSE of 2×16×4 RVQ / direct 2-bit uniform (per-group-of-4 min/max, same 2 code bits) ≈ 0.28;
the test asserts < 0.6.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import CacheCalib, base, get_format
from rq_jax.cache.base import Segment
from rq_jax.cache.residual_vq import ResidualVQ, RVQCalib, RVQSlot, calib_token_index
from rq_jax.quant import affine
from rq_jax.sampling import Sampler, SamplingConfig

L, N, B, K, S, D, H = 2, 2, 2, 2, 80, 8, 4
FAST = dict(iters=6, restarts=2)


def heavy_tailed(key, shape, df=3.0):
    """Student-t samples times per-channel magnitudes (outlier channels), float32."""
    k1, k2 = jax.random.split(key)
    mags = jnp.exp(jax.random.normal(k2, shape[-1:]))
    return jax.random.t(k1, df, shape) * mags


FMT = ResidualVQ(**FAST)
# One compilation per function and shape, shared by the tests (the format is a static argument).
SEG = Segment(0, L, 1)  # L one-loop groups
calibrate = jax.jit(lambda fmt, k, v, lengths: fmt.calibrate(SEG, k[:, None], v[:, None], lengths), static_argnums=0)
write = jax.jit(lambda fmt, state, k, v, *args: fmt.write(state, k[:, None], v[:, None], *args).state, static_argnums=0)


@functools.lru_cache(maxsize=None)
def fitted():
    """Dense K/V [L, N, B, K, S, D] (student-t keys), ragged lengths and a calibration fitted on them."""
    k = heavy_tailed(jax.random.key(0), (L, N, B, K, S, D))
    v = jax.random.normal(jax.random.key(1), (L, N, B, K, S, D))
    lengths = jnp.array([S, S - 30])
    return k, v, lengths, calibrate(FMT, k, v, lengths)


@functools.lru_cache(maxsize=None)
def ragged_state():
    """A state filled by four ragged writes (row 1 gets fewer tokens; padded tokens are garbage)."""
    *_, calib = fitted()
    state = FMT.init(SEG, N, B, S, K, D)
    lengths = jnp.zeros((B,), jnp.int32)
    for num_new in ([20, 7], [1, 0], [30, 25], [5, 9]):
        num_new = jnp.array(num_new)
        chunk = jax.random.normal(jax.random.key(int(lengths.sum())), (2, L, N, B, K, 30, D)) * 2
        state = write(FMT, state, chunk[0], chunk[1], lengths, num_new, calib)
        lengths = lengths + num_new
    return state, lengths


@pytest.mark.parametrize("path", ["lut", "decode", "auto"])
@pytest.mark.parametrize("t", [1, 3])
def test_attend_equals_reference_after_ragged_writes(path, t):
    *_, calib = fitted()
    state, lengths = ragged_state()
    fmt = ResidualVQ(attend_path=path, **FAST)
    q = jax.random.normal(jax.random.key(7), (B, t, H, D)) * 2
    attend = jax.jit(fmt.attend, static_argnums=2)
    for index in ((0, 0), (1, 1)):
        got = attend(state, index, 0, q, lengths, calib)
        want = base.reference_attend(fmt, state, index, 0, q, lengths, calib)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(base.finalize(got), base.finalize(want), atol=1e-5)
    # Nothing is written past a row's length.
    assert not np.any(np.asarray(state[0].k[:, :, 1, :, int(lengths[1]):]))


def test_rvq_beats_direct_2bit_uniform_on_heavy_tails():
    """Same 2 bits/element: RVQ vs a static per-channel 2-bit uniform grid (range over the tokens)."""
    k, v, _, _ = fitted()
    full = jnp.array([S, S])
    calib = calibrate(FMT, k, v, full)
    state = write(FMT, FMT.init(SEG, N, B, S, K, D), k, v, jnp.zeros((B,), jnp.int32), full, calib)
    recon = jnp.stack([jnp.stack([FMT.reconstruct(state, (l, n), 0, full, calib)[0] for n in range(N)])
                       for l in range(L)])
    rvq_err = float(jnp.sum((recon - k) ** 2))
    assert float(jnp.mean((recon - k) ** 2) / jnp.mean(k**2)) < 0.2
    per_channel = jnp.moveaxis(k, 2, 4).reshape(L, N, K, D, B * S)  # one group per (slot, head, channel)
    uniform = affine.fake_quant(per_channel, affine.QuantConfig(bits=2, group_size=B * S))
    ratio = rvq_err / float(jnp.sum((uniform - per_channel) ** 2))
    per_token = affine.fake_quant(k, affine.QuantConfig(bits=2, group_size=D))  # 2 + 16/D bits
    print(f"RVQ / 2-bit uniform squared error: {ratio:.3f} (per-channel, 2 bits), "
          f"{rvq_err / float(jnp.sum((per_token - k) ** 2)):.3f} (per-token groups of D, {2 + 16 / D:g} bits)")
    assert ratio < 0.3


def test_calibrate_ignores_padding():
    k, v, lengths, calib = fitted()
    pad = jnp.arange(S)[None, :] >= lengths[:, None]  # [B, S]
    pad = pad[None, None, :, None, :, None]
    noisy = calibrate(FMT, jnp.where(pad, 1e3, k), jnp.where(pad, -7.0, v), lengths)
    for a, b in zip(jax.tree_util.tree_leaves(calib), jax.tree_util.tree_leaves(noisy)):
        np.testing.assert_array_equal(a, b)
    assert calib.k.c1.shape == (L, N, 16, 4) and calib.v.scale.shape == (L, N, K, D)
    # The picked tokens are spread over every valid token, never a padded one.
    idx = np.asarray(calib_token_index(jnp.array([5, 2]), 6, 12))
    assert set(idx) == {0, 1, 2, 3, 4, 6, 7}


def test_nbytes_and_bits_per_element():
    fmt = ResidualVQ()
    (slot,) = fmt.init(SEG, N, B, S, K, 16)
    assert isinstance(slot, RVQSlot) and slot.k.dtype == jnp.uint8
    assert base.tree_nbytes(slot) == slot.k.nbytes + slot.v.nbytes
    assert fmt.bits_per_element(L, 16) == 2
    elements = 2 * L * N * B * K * S * 16
    assert base.tree_nbytes(slot) == fmt.bits_per_element(L, 16) * elements / 8
    assert ResidualVQ(group=8).bits_per_element(1, 16) == 1


def test_missing_calibration_and_bad_policies_raise():
    fmt = get_format("residual_vq")
    assert isinstance(fmt, ResidualVQ) and fmt.needs_data
    assert fmt.needs_calib
    with pytest.raises(ValueError, match="needs calibration .* no data-free default"):
        fmt.default_calib(Segment(0, 1, 1), 1, 1, 8)
    for bad in (dict(n_codes=17), dict(group=0), dict(iters=0), dict(attend_path="fused")):
        with pytest.raises(ValueError, match="residual_vq"):
            ResidualVQ(**bad)
    with pytest.raises(ValueError, match="divide the head dim"):
        ResidualVQ(group=3).init(Segment(0, 1, 1), 1, 1, 4, 1, 8)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_sampler_generates_without_retracing(family, request):
    model, ref = request.getfixturevalue(family)
    kw = dict(num_loops=4) if family == "huginn" else {}
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), ResidualVQ(iters=4, restarts=1),
                      return_logits=True, **kw)
    prompts = [list(ref["input_ids"][0, :7]), list(ref["input_ids"][1, :4])]
    out = sampler(prompts)
    assert np.all(np.isfinite(out.logits)) and out.tokens.shape == (2, 4)
    assert isinstance(out.cache.looped[0][0], RVQSlot)
    traces, calib_traces = sampler.num_compiled(), sampler._calibrate._cache_size()
    again = sampler([list(ref["input_ids"][1, :7]), list(ref["input_ids"][0, :4])], seed=1)
    assert np.all(np.isfinite(again.logits))
    assert sampler.num_compiled() == traces and sampler._calibrate._cache_size() == calib_traces == 1
    # A given calibration is used as is, through the same compiled prefill/decode: the same tokens.
    padded = jnp.asarray([p + [0] * (7 - len(p)) for p in prompts], jnp.int32)
    calib = sampler._calibrate(sampler.params, padded, jnp.array([7, 4], jnp.int32),
                               jax.random.fold_in(jax.random.key(0), 1))
    assert isinstance(calib, CacheCalib) and isinstance(calib.looped[0], RVQCalib)
    sampler.calib = calib
    np.testing.assert_array_equal(sampler(prompts).tokens, out.tokens)
    assert sampler.num_compiled() == traces
