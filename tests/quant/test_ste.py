"""Straight-through estimators: forward bit-exact with the quantizer, gradient identity (masked
outside the clip interval for affine)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rq_jax.quant import affine, residual, rvq
from rq_jax.quant.ste import ste_fake_quant, ste_residual_group, ste_rvq, straight_through

from ._data import make_data


def _value_and_grad(f):
    """Jitted (forward, d sum(w * f(x)) / dx)."""
    return jax.jit(lambda x, w: (f(x), jax.grad(lambda t: jnp.sum(w * f(t)))(x)))


@functools.lru_cache(maxsize=None)
def _affine_vg(cfg):
    return _value_and_grad(lambda t: ste_fake_quant(t, cfg))


@settings(max_examples=25, deadline=None)
@given(
    cfg=st.sampled_from(
        [affine.QuantConfig(b, g, symmetric=s) for b in (2, 4) for g in (16, 32) for s in (False, True)]
        + [affine.QuantConfig(3, 32, meta_dtype=jnp.bfloat16), affine.QuantConfig(1, 16, clip=1.0)]
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_affine_forward_exact_gradient_masked(cfg, seed):
    x = make_data(seed, (3, 32), "heavy")
    w = make_data(seed + 1, (3, 32))
    fwd, grad = _affine_vg(cfg)(x, w)
    np.testing.assert_array_equal(np.asarray(fwd), np.asarray(affine.fake_quant(x, cfg)))
    lo, hi = (np.asarray(v)[..., None] for v in affine.clip_range(x, cfg))
    xg = x.reshape(3, -1, cfg.group_size)
    inside = ((xg >= lo) & (xg <= hi)).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(grad), np.where(inside, w, 0.0))
    if cfg.clip_factor == 1.0:
        assert inside.all()  # no clipping: the gradient is exactly the identity


def test_affine_unmasked_is_identity_and_bf16_input():
    cfg = affine.QuantConfig(2, 16)  # clip 0.9 cuts the extremes
    x = make_data(0, (4, 32), "outlier")
    g = jax.grad(lambda t: jnp.sum(ste_fake_quant(t, cfg, mask_clipped=False)))(x)
    np.testing.assert_array_equal(np.asarray(g), 1.0)
    gm = jax.grad(lambda t: jnp.sum(ste_fake_quant(t, cfg)))(x)
    assert 0 < float(jnp.sum(gm == 0)) < x.size
    xb = jnp.asarray(x, jnp.bfloat16)
    out = ste_fake_quant(xb, cfg)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(affine.fake_quant(xb, cfg, jnp.bfloat16)))


def test_rvq_ste():
    x = make_data(2, (64, 2, 16), "heavy")
    books = rvq.fit_rvq(jax.random.key(0), x, restarts=1, iters=5)
    w = make_data(3, x.shape)
    fwd, grad = _value_and_grad(lambda t: ste_rvq(t, books))(x, w)
    want = jax.jit(lambda t: rvq.decode(rvq.encode(t, books), books))(x)
    np.testing.assert_array_equal(np.asarray(fwd), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(grad), w)


@pytest.mark.parametrize("reference", ["last", "previous"])
def test_residual_group_ste(reference):
    cfg = residual.ResidualConfig((2, 2, 4), 16, reference=reference)
    z = make_data(4, (3, 5, 32))
    mean = make_data(5, (3, 1, 32), "normal", 0.1)
    w = make_data(6, z.shape)
    fwd, grad = _value_and_grad(lambda t: ste_residual_group(t, cfg, mean))(z, w)
    ref = jax.jit(lambda t: residual.decode_group(residual.encode_group(t, cfg, mean), cfg, mean))(z)
    np.testing.assert_array_equal(np.asarray(fwd), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(grad), w)


def test_straight_through_vmap_and_jvp():
    x = jnp.arange(6.0).reshape(2, 3)
    q = jnp.round(x / 2)
    out = jax.vmap(lambda a, b: straight_through(a, b, jnp.ones(())))(x, q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q))
    _, t = jax.jvp(lambda a: straight_through(a, q, jnp.array([1.0, 0.0, 1.0])), (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(np.asarray(t), [[1, 0, 1], [1, 0, 1]])
