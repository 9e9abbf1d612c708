"""Planar bit packing: round trips, the documented layout, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rq_jax.quant.packing import pack, packed_dim, unpack

_pack = jax.jit(pack, static_argnums=1)
_unpack = jax.jit(unpack, static_argnums=(1, 2))


@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    dim=st.sampled_from([8, 16, 24, 96, 128]),
    lead=st.sampled_from([(), (3,), (2, 1, 2)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip(bits, dim, lead, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, lead + (dim,)).astype(np.uint8)
    p = _pack(codes, bits)
    assert p.dtype == jnp.uint8 and p.shape == lead + (dim * bits // 8,)
    assert packed_dim(dim, bits) == dim * bits // 8
    np.testing.assert_array_equal(np.asarray(_unpack(p, bits, dim)), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_planar_layout(bits):
    dim = 32
    per = 8 // bits
    j = dim // per
    codes = np.random.default_rng(bits).integers(0, 2**bits, (2, dim)).astype(np.uint8)
    want = np.zeros((2, j), np.uint32)
    for k in range(per):
        want |= codes[:, k * j : (k + 1) * j].astype(np.uint32) << (k * bits)
    np.testing.assert_array_equal(np.asarray(pack(codes, bits)), want.astype(np.uint8))


def test_three_bit_layout_is_two_planes():
    codes = np.random.default_rng(0).integers(0, 8, (4, 24)).astype(np.uint8)
    p = np.asarray(pack(codes, 3))
    np.testing.assert_array_equal(p[:, :6], np.asarray(pack(codes & 3, 2)))
    np.testing.assert_array_equal(p[:, 6:], np.asarray(pack(codes >> 2, 1)))


def test_eight_bit_is_identity_and_errors():
    c = np.arange(16, dtype=np.uint8)[None]
    np.testing.assert_array_equal(np.asarray(pack(c, 8)), c)
    with pytest.raises(ValueError, match="divisible by 4"):
        pack(np.zeros((1, 6), np.uint8), 2)
    with pytest.raises(ValueError, match="divisible by 8"):
        packed_dim(12, 3)
    with pytest.raises(ValueError, match="invalid bit width"):
        packed_dim(16, 5)
    with pytest.raises(ValueError, match="packed last dim"):
        unpack(np.zeros((1, 3), np.uint8), 2, 16)
