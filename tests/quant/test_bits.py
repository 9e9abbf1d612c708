"""Exact storage accounting against the spec's worked values and real packed byte counts."""

from fractions import Fraction as F

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.quant import affine, bits, residual
from rq_jax.quant.affine import QuantConfig
from rq_jax.quant.residual import ResidualConfig

from ._data import make_data


def _direct(sched, g2, g4=32):
    return [QuantConfig(b, g4 if b == 4 else g2) for b in sched]


def _res(sched, g2, g4=32, **kw):
    return ResidualConfig(tuple(sched), tuple(g4 if b == 4 else g2 for b in sched), **kw)


def test_ouro_headline_values():
    b = bits.bits_per_element(_res([2, 2, 2, 4], 32), head_dim=128)
    assert b == F(99, 32) == 3.09375
    assert round(float(bits.saving(b)) * 100, 1) == 80.7
    assert bits.bits_per_element(_res([2, 2, 2, 2], 32), 128) == F(83, 32) == 2.59375
    assert bits.bits_per_element(_res([2, 2, 2, 2], 32, least_squares=False), 128) == 2.5


@pytest.mark.parametrize(
    "sched,g2,direct,resid",
    [
        ([2, 2, 2, 2], 32, F(5, 2), F(83, 32)),
        ([2, 2, 2, 2], 16, F(3), F(99, 32)),
        ([2, 2, 2, 4], 32, F(3), F(99, 32)),
        ([2, 2, 2, 4], 16, F(27, 8), F(111, 32)),
        ([4, 4, 4, 4], 32, F(9, 2), F(147, 32)),
    ],
)
def test_spec_worked_values_ouro(sched, g2, direct, resid):
    assert bits.bits_per_element(_direct(sched, g2)) == direct
    assert bits.bits_per_element(_res(sched, g2), head_dim=128) == resid


@pytest.mark.parametrize(
    "n_res,g2,want",
    [
        (3, 16, F(7, 2)),  # 8 x [2,2,2,4]: 3.5
        (3, 32, F(25, 8)),  # 3.125
        (7, 16, F(10, 3)),  # 4 x [2^7,4]: 3.333...
        (7, 32, F(139, 48)),  # 2.8958...
        (15, 16, F(13, 4)),  # 2 x [2^15,4]: 3.25 (79.7% saving)
        (15, 32, F(89, 32)),  # 2.78125 (82.6% saving)
    ],
)
def test_spec_values_huginn(n_res, g2, want):
    got = bits.bits_per_element(_res([2] * n_res + [4], g2), head_dim=96)
    assert got == want
    assert round(float(got), 2) == round(float(want), 2)


def test_huginn_savings():
    assert round(float(bits.saving(F(13, 4))) * 100, 1) == 79.7
    assert round(float(bits.saving(F(89, 32))) * 100, 1) == 82.6


def test_other_schemes():
    assert bits.bits_per_element("rvq") == 2
    assert bits.bits_per_element(QuantConfig(2, 32, symmetric=True)) == F(9, 4)
    assert bits.bits_per_element(QuantConfig(4, 32, meta_dtype=jnp.bfloat16)) == 5
    with pytest.raises(ValueError, match="head_dim"):
        bits.bits_per_element(_res([2, 4], 32))


@pytest.mark.parametrize(
    "sched,g2,d,extra",
    [
        ([2, 2, 2, 4], 32, 128, {}),
        ([2, 2, 2, 4], 16, 96, {}),
        ([2] * 7 + [4], 32, 96, {"reference": "next"}),
        ([4, 3, 1, 8], 16, 96, {"reference": "first", "alpha_dtype": jnp.float32, "meta_dtype": jnp.float16}),
        ([2, 2], 8, 24, {"least_squares": False}),
    ],
)
def test_real_bytes_match_accounting(sched, g2, d, extra):
    """Packed codes + scales + offsets + alpha arrays hold exactly bits_per_element * n / 8 bytes."""
    cfg = _res(sched, g2, g4=32 if d % 32 == 0 else 8, **extra)
    t, h = 8, 2
    z = make_data(0, (len(sched), t, h, d))
    enc = jax.jit(residual.encode_group, static_argnums=1)(z, cfg)
    want = bits.bits_per_element(cfg, head_dim=d) * z.size / 8
    assert want.denominator == 1
    assert bits.stored_nbytes(enc, cfg) == want


def test_ouro_bytes_per_token_head():
    """Spec §5: 198 B per layer/head/K-or-V for [2,2,2,4] g32 (vs 1024 B BF16)."""
    cfg = _res([2, 2, 2, 4], 32)
    enc = jax.jit(residual.encode_group, static_argnums=1)(make_data(1, (4, 1, 128)), cfg)
    assert bits.stored_nbytes(enc, cfg) == 198


@pytest.mark.parametrize("b", [1, 2, 3, 4, 8])
def test_direct_bytes(b):
    cfg = QuantConfig(b, 32, symmetric=b == 8)
    x = make_data(b, (3, 96))
    q = jax.jit(affine.quantize, static_argnums=1)(x, cfg)
    assert bits.stored_nbytes(q, cfg) == bits.bits_per_element(cfg) * x.size / 8
    assert bits.stored_nbytes(np.zeros((2, 3), np.uint8)) == 6
