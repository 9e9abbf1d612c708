"""The split-K plan and the log-sum-exp combine shared by the decode kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_common as dc

from ._base import seeded


@pytest.mark.parametrize("batch, heads, rows, seq_len", [
    (1, 16, 1, 32768), (4, 55, 1, 1024), (2, 2, 3, 100), (1, 1, 80, 40), (8, 16, 1, 16),
])
@pytest.mark.parametrize("block_s", [16, 32, 64])
def test_plan_covers_the_sequence(batch, heads, rows, seq_len, block_s):
    plan = dc.plan_decode(batch, heads, rows, seq_len, block_s=block_s)
    assert plan.split_len % plan.block_s == 0
    assert plan.num_splits * plan.split_len >= seq_len > (plan.num_splits - 1) * plan.split_len
    assert plan.block_r >= 16 and plan.block_r & (plan.block_r - 1) == 0 and plan.block_r <= dc.MAX_BLOCK_R
    tiles = -(-seq_len // block_s)
    if plan.num_splits > 1:  # splits keep a minimum of work each
        assert plan.split_len // block_s >= min(dc.MIN_TILES_PER_SPLIT, tiles)


def test_plan_fills_the_gpu_at_batch_one():
    plan = dc.plan_decode(1, 16, 1, 16384, block_s=32)
    assert 16 * plan.num_splits >= dc.TARGET_PROGRAMS // 2


def test_plan_rejects_non_power_of_two_tiles():
    with pytest.raises(NotImplementedError):
        dc.plan_decode(1, 1, 1, 100, block_s=48)
    with pytest.raises(NotImplementedError):
        dc.plan_decode(1, 1, 1, 100, block_s=32, block_r=24)


def test_combine_splits_is_the_softmax_over_all_splits():
    rng = seeded("combine")
    scores = rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)  # [B, K, splits, R, tokens]
    values = rng.standard_normal((2, 3, 4, 6, 8)).astype(np.float32)  # [B, K, splits, tokens, D]
    m = scores.max(-1)
    p = np.exp(scores - m[..., None])
    m[1, :, 2] = dc.NEG  # an empty split
    p[1, :, 2] = 0.0
    acc, m_all, l_all = dc.combine_splits(jnp.asarray(np.einsum("bkjrs,bkjsd->bkjrd", p, values)),
                                          jnp.asarray(m), jnp.asarray(p.sum(-1)))
    mask = np.ones_like(scores, bool)
    mask[1, :, 2] = False
    flat_s = np.where(mask, scores, -np.inf).transpose(0, 1, 3, 2, 4).reshape(2, 3, 5, 24)
    flat_v = values.reshape(2, 3, 24, 8)
    want_m = flat_s.max(-1)
    want_p = np.exp(flat_s - want_m[..., None])
    np.testing.assert_allclose(np.asarray(m_all), want_m, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l_all), want_p.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(acc), np.einsum("bkrs,bksd->bkrd", want_p, flat_v), rtol=1e-5, atol=1e-5)


def test_combine_of_empty_splits_is_finite_zero():
    acc, m, l = dc.combine_splits(jnp.zeros((1, 1, 3, 2, 4)), jnp.full((1, 1, 3, 2), dc.NEG), jnp.zeros((1, 1, 3, 2)))
    assert (np.asarray(acc) == 0).all() and (np.asarray(l) == 0).all()
    assert (np.asarray(m) == np.float32(dc.NEG)).all()


def test_float8_bits_decode_exactly():
    """Every finite float8_e4m3fn bit pattern decodes to its value (the Ampere path of FP8 metadata)."""
    bits = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
    got = np.asarray(dc.float8_e4m3fn_bits_to_f32(bits))
    finite = np.isfinite(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])


def test_float16_bits_decode_exactly():
    """Every float16 bit pattern decodes to its value, subnormals, signed zeros, infinities and NaNs included
    (the TPU path of float16 metadata)."""
    bits = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16)
    want = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32))
    got = np.asarray(dc.float16_bits_to_f32(bits))
    nan = np.isnan(want)
    assert nan.sum() == 2046 and np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.parametrize("kernel", ["pallas", "tpu"])
@pytest.mark.parametrize("stored, table, message", [
    ((1, 6, 2, 16, 32), None, r"cache batch/heads \(6, 2\) != queries' \(3, 2\) \(a paged pool needs a block_table\)"),
    ((1, 6, 2, 16, 32), np.zeros((3, 2), np.float32), r"block_table must be integer \[3, N\]"),
    ((1, 6, 2, 16, 32), np.zeros((2, 2), np.int32), r"block_table must be integer \[3, N\]"),
    ((1, 6, 4, 16, 32), np.zeros((3, 2), np.int32), r"pool kv heads 4 != queries' 2"),
])
def test_a_pool_and_its_table_are_checked(kernel, stored, table, message):
    """The dense kernels (Triton and Mosaic) refuse a pool without a table, a table of the wrong dtype or rows,
    and a pool whose kv heads are not the queries' — by name, at trace time (`decode_common.check_table`)."""
    from pallas_kernels import dense_decode_attention
    from pallas_kernels.tpu_dense_attention import tpu_dense_decode_attention

    fn = dense_decode_attention if kernel == "pallas" else tpu_dense_decode_attention
    q = jnp.zeros((3, 2, 1, 32), jnp.float32)
    kv = jnp.zeros(stored, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        fn(q, kv, kv, jnp.zeros(3, jnp.int32), 0, None if table is None else jnp.asarray(table), interpret=True)
