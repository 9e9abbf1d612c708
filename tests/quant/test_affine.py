"""Affine group quantizer: arithmetic of the spec, error bounds, robustness, jit/vmap."""

import fractions
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rq_jax.quant import affine
from rq_jax.quant.affine import QuantConfig, dequantize, fake_quant, quantize

from ._data import BITS, META, SHAPES, data_args, make_data

FAST = settings(max_examples=25, deadline=None)


_quantize = jax.jit(quantize, static_argnums=1)
_dequantize = jax.jit(dequantize, static_argnums=(1, 2))
_fake_quant = jax.jit(fake_quant, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=1)
def _qdq(x, cfg):
    """One compilation for codes and reconstruction (compiles dominate the test time)."""
    q = quantize(x, cfg)
    return q, dequantize(q, cfg)


def _bound_check(x, cfg, q, xh):
    """|x - x_hat| <= s/2 + distance of x to the representable range (per group, float32)."""
    g = cfg.group_size
    xg = x.reshape(*x.shape[:-1], -1, g).astype(np.float64)
    s = np.asarray(q.scale.astype(jnp.float32), np.float64)[..., None]
    if cfg.symmetric:
        qmax = 2 ** (cfg.bits - 1) - 1
        lo, hi = -qmax * s, qmax * s
    else:
        lo = np.asarray(q.offset.astype(jnp.float32), np.float64)[..., None]
        hi = lo + s * (2**cfg.bits - 1)
    dist = np.maximum(lo - xg, 0) + np.maximum(xg - hi, 0)
    err = np.abs(np.asarray(xh, np.float64).reshape(xg.shape) - xg)
    tol = 1e-5 * (np.abs(xg) + np.abs(lo) + np.abs(hi)) + 1e-30
    assert np.all(err <= dist + s / 2 + tol)


@FAST
@given(
    bits=st.sampled_from(BITS),
    shape=st.sampled_from(SHAPES),
    meta=st.sampled_from(META),
    symmetric=st.booleans(),
    **data_args,
)
def test_codes_and_error_bound(bits, shape, meta, symmetric, seed, kind, scale):
    if symmetric and bits == 1:
        return
    g, d = shape
    cfg = QuantConfig(bits, g, symmetric=symmetric, meta_dtype=jnp.dtype(meta))
    x = make_data(seed, (3, d), kind, scale)
    q, xh = _qdq(x, cfg)
    assert q.codes.shape == x.shape and q.codes.dtype == jnp.uint8
    assert q.scale.shape == (3, d // g) and q.scale.dtype == jnp.dtype(meta)
    assert int(q.codes.max()) < 2**bits
    if symmetric:
        assert q.offset is None and int(q.codes.min()) >= 1
    else:
        assert q.offset.shape == q.scale.shape
    xh = np.asarray(xh)
    assert np.all(np.isfinite(xh))
    _bound_check(x, cfg, q, xh)


@FAST
@given(bits=st.sampled_from(BITS), shape=st.sampled_from(SHAPES), clip=st.sampled_from([1.0, 0.9, 0.5]),
       **data_args)
def test_half_step_with_exact_metadata(bits, shape, clip, seed, kind, scale):
    """float32 metadata: error <= half a step + what the clip factor cut off."""
    g, d = shape
    cfg = QuantConfig(bits, g, meta_dtype=jnp.float32, clip=clip)
    x = make_data(seed, (2, d), kind, scale).astype(np.float64)
    xh = np.asarray(_fake_quant(x.astype(np.float32), cfg), np.float64)
    xg = x.reshape(2, -1, g)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    rad = (hi - lo) / 2
    step = 2 * rad * clip / (2**bits - 1)
    err = np.abs(xh.reshape(xg.shape) - xg)
    assert np.all(err <= step / 2 + rad * (1 - clip) + 1e-5 * np.abs(xg).max(-1, keepdims=True) + 1e-30)


@FAST
@given(shape=st.sampled_from(SHAPES), bits=st.sampled_from(BITS), meta=st.sampled_from(META),
       seed=st.integers(0, 2**31 - 1))
def test_constant_groups_exact(shape, bits, meta, seed):
    """A constant group representable in the metadata dtype is reconstructed exactly."""
    g, d = shape
    cfg = QuantConfig(bits, g, meta_dtype=jnp.dtype(meta))
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(d // g) * 10.0 ** rng.integers(-2, 3, d // g)
    vals = np.asarray(jnp.asarray(vals, jnp.float32).astype(meta).astype(jnp.float32))
    x = np.repeat(vals, g)[None]
    np.testing.assert_array_equal(np.asarray(_fake_quant(x, cfg)), x)


def test_round_half_down_and_levels():
    cfg = QuantConfig(2, 8, meta_dtype=jnp.float32, clip=1.0)
    x = jnp.array([[0.0, 3.0, 0.5, 1.5, 2.5, 0.51, 1.49, 2.99]])
    q = _quantize(x, cfg)
    np.testing.assert_array_equal(np.asarray(q.codes), [[0, 3, 0, 1, 2, 1, 1, 3]])
    assert float(q.scale[0, 0]) == 1.0 and float(q.offset[0, 0]) == 0.0


# Exact ties at scales whose reciprocal is not exact (1/7.5, 1/1.5): XLA would multiply by 1/scale
# under jit (u = 1.5 -> 1.5000001) unless the quantizer stops it. Each case: (config kwargs, x, codes
# half down, codes half even).
TIES = [
    (dict(bits=2, group_size=8, clip=1.0),  # offset 10, scale 7.5; u = .5, 1.5, 2.5 at 13.75, 21.25, 28.75
     [10, 32.5, 13.75, 21.25, 28.75, 10, 10, 10], [0, 3, 0, 1, 2, 0, 0, 0], [0, 3, 0, 2, 2, 0, 0, 0]),
    (dict(bits=2, group_size=4, clip=1.0), [10, 32.5, 21.25, 10], [0, 3, 1, 0], [0, 3, 2, 0]),  # issue 8's repro
    (dict(bits=4, group_size=8, clip=1.0),  # offset 0, scale 1.5; u = .5, 1.5, 2.5, 13.5
     [0, 22.5, 0.75, 2.25, 3.75, 20.25, 0, 0], [0, 15, 0, 1, 2, 13, 0, 0], [0, 15, 0, 2, 2, 14, 0, 0]),
    (dict(bits=4, group_size=4, symmetric=True),  # scale 10.5 / 7 = 1.5; u = 1.5, -1.5, 7; zero point 8
     [2.25, -2.25, 10.5, 0.0], [9, 6, 15, 8], [10, 6, 15, 8]),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kwargs,x,down,even", TIES)
def test_exact_ties_round_by_the_rule_jitted_and_not(kwargs, x, down, even, jit):
    x = jnp.asarray([x], jnp.float32)
    for rounding, want in (("half_down", down), ("half_even", even)):
        cfg = QuantConfig(meta_dtype=jnp.float32, rounding=rounding, **kwargs)
        q = (_quantize if jit else quantize)(x, cfg)
        np.testing.assert_array_equal(np.asarray(q.codes)[0], want, err_msg=rounding)
        if jit:  # inside a larger fused program too
            np.testing.assert_array_equal(_qdq(x, cfg)[0].codes, q.codes)


@pytest.mark.parametrize("jit", [False, True])
def test_fp8_offset_rounds_the_exact_midpoint_to_even(jit):
    """mid - 0.9·rad is exactly -3.875 (the midpoint of fp8 -3.75 and -4.0) when the product is rounded
    before the subtraction, as written; a fused multiply-add gives -3.8749998, which rounds to -3.75."""
    lo, hi = np.float32(-4.4218755), np.float32(6.515636)
    mid, rad = np.float32(hi / 2 + lo / 2), np.float32(hi / 2 - lo / 2)
    assert np.float32(mid - np.float32(np.float32(0.9) * rad)) == -3.875
    x = jnp.asarray([[lo, hi, lo, hi]], jnp.float32)
    quant = _quantize if jit else quantize
    assert float(quant(x, QuantConfig(2, 4, meta_dtype=jnp.float32)).offset[0, 0]) == -3.875
    assert float(quant(x, QuantConfig(2, 4)).offset[0, 0].astype(jnp.float32)) == -4.0  # round half to even
    assert float(_qdq(x, QuantConfig(2, 4))[0].offset[0, 0].astype(jnp.float32)) == -4.0


def test_clip_one_offset_is_the_minimum_and_scale_kivis():
    """clip 1: offset = min and scale = (max - min) / (2^b - 1) exactly, also where (hi+lo)/2 - (hi-lo)/2
    rounds away from lo in float32 (here it would give 0)."""
    x = jnp.asarray([[1e-8, 1.0, 0.3, 0.7], [-3.3, 7.1, 0.2, 5.0]], jnp.float32)
    for cfg in (QuantConfig(2, 4, meta_dtype=jnp.float32, clip=1.0), QuantConfig(4, 4, meta_dtype=jnp.float32)):
        q = _quantize(x, cfg)
        xn = np.asarray(x)
        np.testing.assert_array_equal(np.asarray(q.offset)[:, 0], xn.min(1))
        np.testing.assert_array_equal(np.asarray(q.scale)[:, 0],
                                      (xn.max(1) - xn.min(1)) / np.float32(2**cfg.bits - 1))


def test_int2_default_clip_is_0p9():
    assert QuantConfig(2, 32).clip_factor == 0.9
    assert QuantConfig(4, 32).clip_factor == 1.0
    cfg = QuantConfig(2, 4, meta_dtype=jnp.float32)
    q = _quantize(jnp.array([[0.0, 1.0, 2.0, 10.0]]), cfg)
    assert float(q.offset[0, 0]) == pytest.approx(0.5)  # mid 5 - rad 5 * 0.9
    assert float(q.scale[0, 0]) == pytest.approx(9.0 / 3)


@pytest.mark.parametrize("meta", META)
@pytest.mark.parametrize("bits,symmetric", [(b, s) for b in BITS for s in (False, True) if b > 1 or not s])
def test_no_nan_on_extremes(meta, bits, symmetric):
    cfg = QuantConfig(bits, 8, symmetric=symmetric, meta_dtype=jnp.dtype(meta))
    big = 1e38  # documented finite-output domain: |x| <= 1e38
    rows = [
        [0.0] * 8,
        [1.5] * 8,
        [big, -big, big, 0, 1, -1, big / 2, -big],
        [1e30, 1e29, -1e30, 5, 1e30, 1e30, 1e30, 1e30],
        [1e-30, 2e-30, 0, 1e-45, -1e-45, 1e-38, 0, 0],
        [448, -448, 449, 2.0**-9, 2.0**-10, 464, -500, 0],
        [1e-4, 1e-4 + 1e-6, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4 + 2e-6],
        [1e30, 1e-30, -1e-30, 0, 0, 0, 0, 0],
    ]
    x = jnp.array(rows, jnp.float32)
    q, xh = _qdq(x, cfg)
    assert np.all(np.isfinite(np.asarray(q.scale.astype(jnp.float32))))
    xh = np.asarray(xh)
    assert np.all(np.isfinite(xh))
    np.testing.assert_array_equal(xh[0], 0.0)


def test_fp8_underflow_collapses_to_offset():
    cfg = QuantConfig(2, 8)  # fp8: smallest subnormal 2^-9, range 1e-6 -> scale 0
    x = jnp.full((1, 8), 0.25) + jnp.linspace(0, 1e-6, 8)
    q = _quantize(x, cfg)
    assert float(q.scale[0, 0]) == 0.0
    np.testing.assert_array_equal(np.asarray(_dequantize(q, cfg)), float(q.offset[0, 0].astype(jnp.float32)))


@pytest.mark.parametrize("d,g", [(96, 32), (24, 8)])
def test_jit_vmap_and_head_dims(d, g):
    cfg = QuantConfig(4, g, meta_dtype=jnp.bfloat16)
    x = make_data(0, (5, 2, d), "heavy")
    q = _quantize(x, cfg)
    qv = jax.jit(jax.vmap(lambda t: quantize(t, cfg)))(x)
    assert q.super_scale is None and qv.super_scale is None
    for a, b in zip(q[:3], qv[:3]):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    out = _dequantize(q, cfg, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape


def test_config_validation():
    with pytest.raises(ValueError, match="invalid bit width"):
        QuantConfig(5, 32)
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig(2, 0)
    with pytest.raises(ValueError, match="unsupported meta dtype"):
        QuantConfig(2, 32, meta_dtype=jnp.int8)
    with pytest.raises(ValueError, match="symmetric"):
        QuantConfig(1, 32, symmetric=True)
    with pytest.raises(ValueError, match="clip"):
        QuantConfig(2, 32, clip=1.5)
    with pytest.raises(ValueError, match="rounding must be one of"):
        QuantConfig(2, 32, rounding="nearest")
    with pytest.raises(ValueError, match="D=96.*g=64"):
        quantize(jnp.zeros((2, 96)), QuantConfig(2, 64))
    assert hash(QuantConfig(2, 32)) == hash(QuantConfig(2, 32, meta_dtype=jnp.float8_e4m3fn))
    assert affine.default_clip(2) == 0.9


def test_16_bit_passthrough_is_bfloat16_storage():
    from rq_jax.quant import bits, packing

    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 32)), jnp.float32)
    cfg = QuantConfig(16, 8)
    q = quantize(x, cfg)
    assert q.codes.dtype == jnp.bfloat16 and q.scale.shape == (3, 0)
    np.testing.assert_array_equal(dequantize(q, cfg), x.astype(jnp.bfloat16).astype(jnp.float32))
    assert packing.pack(q.codes, 16) is q.codes and packing.unpacked_dim(32, 16) == 32
    assert bits.bits_per_element(cfg) == 16


def _outlier_rows():
    """Rows (vectors) of values ~1e-3 beside rows of outliers ~1e4, one 64-channel vector each."""
    rng = np.random.default_rng(0)
    small = rng.uniform(-1e-3, 1e-3, (4, 64))
    big = rng.uniform(5e3, 1e4, (4, 64)) * rng.choice([-1, 1], (4, 64))
    return jnp.asarray(np.concatenate([small, big]), jnp.float32)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("jit", [False, True])
def test_super_scale_round_trips_outliers_that_plain_fp8_clips(bits, jit):
    """1e4 outliers beside 1e-3 values: plain FP8 metadata saturates (and flushes the small groups'
    scales) and `out_of_range` reports it; with the per-vector super-scale every group reconstructs
    within its quantizer's error bound (half a step, plus the clipped tail at INT2) and nothing is counted."""
    x = _outlier_rows()
    plain, sup = QuantConfig(bits, 32), QuantConfig(bits, 32, super_scale=True)
    q_fn, oor_fn = (jax.jit(quantize, static_argnums=1), jax.jit(affine.out_of_range, static_argnums=1)) if jit else \
        (quantize, affine.out_of_range)
    counts = np.asarray(oor_fn(x, plain))
    assert counts.shape == (8,) and np.all(counts > 0)
    assert np.abs(np.asarray(dequantize(q_fn(x, plain), plain)) - x).max() > 1e3
    assert np.all(np.asarray(oor_fn(x, sup)) == 0)
    q = q_fn(x, sup)
    assert q.super_scale.dtype == jnp.bfloat16 and q.super_scale.shape == (8, 1) and q.scale.dtype == jnp.float8_e4m3fn
    err = np.abs(np.asarray(dequantize(q, sup)) - np.asarray(x)).reshape(8, 2, 32)
    xg = np.asarray(x).reshape(8, 2, 32)
    step = (xg.max(-1) - xg.min(-1)) / (2**bits - 1)
    # half a step, the INT2 clip tail (0.1 of the range), and E4M3's relative metadata rounding (2**-4)
    bound = step * (0.5 + (0.1 * (2**bits - 1) if bits == 2 else 0) + 2**-4 * 2**bits) + 2**-4 * np.abs(xg).max(-1)
    assert np.all(err.max(-1) <= bound)


def test_super_scale_is_counted_in_the_bits():
    from rq_jax.quant.bits import affine_bits

    assert affine_bits(QuantConfig(2, 32), 64) == 2 + fractions.Fraction(16, 32)
    want = 2 + fractions.Fraction(16, 32) + fractions.Fraction(16, 64)
    assert affine_bits(QuantConfig(2, 32, super_scale=True), 64) == want
    with pytest.raises(ValueError, match="head_dim"):
        affine_bits(QuantConfig(2, 32, super_scale=True))
    from rq_jax.quant.bits import stored_nbytes

    for cfg in (QuantConfig(2, 32), QuantConfig(2, 32, super_scale=True)):  # the arrays' own bytes
        assert stored_nbytes(quantize(_outlier_rows(), cfg), cfg) == affine_bits(cfg, 64) * 8 * 64 / 8


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("super_scale", [False, True])
def test_non_finite_inputs_stay_in_their_place(symmetric, super_scale):
    """inf/NaN entries are counted; every finite entry reconstructs as if they were absent (the group's
    range comes from its finite values), and the non-finite ones come back finite (clip values / offset)."""
    cfg = QuantConfig(4, 8, symmetric=symmetric, super_scale=super_scale)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    dirty = x.copy()
    dirty[0, 3], dirty[0, 5], dirty[1, 0] = np.inf, np.nan, -np.inf
    ref = x.copy()  # the same groups with the bad entries replaced by values inside the finite range
    ref[0, 3], ref[0, 5], ref[1, 0] = x[0, 4], x[0, 4], x[1, 1]
    out = np.asarray(jax.jit(fake_quant, static_argnums=1)(jnp.asarray(dirty), cfg))
    clean = np.asarray(fake_quant(jnp.asarray(ref), cfg))
    assert np.all(np.isfinite(out))
    keep = np.isfinite(dirty)
    np.testing.assert_array_equal(out[keep], clean[keep])
    np.testing.assert_array_equal(np.asarray(affine.out_of_range(jnp.asarray(dirty), cfg)), [2, 1])
