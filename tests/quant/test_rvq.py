"""Two-stage residual VQ: k-means, stage-2 gain, head-local groups, packing, error vs uniform INT2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.quant import affine, bits, rvq


@pytest.fixture(scope="module")
def fitted():
    """Heavy-tailed states: Student-t(4) times log-normal per-channel scales, [N=512, H=2, D=64]."""
    rng = np.random.default_rng(0)
    chs = np.exp(rng.normal(0, 1.0, (2, 64)))
    x = (rng.standard_t(4, (512, 2, 64)) * chs).astype(np.float32)
    books = rvq.fit_rvq(jax.random.key(0), x, restarts=2, iters=15)
    return x, books


def test_kmeans_recovers_separated_clusters_and_is_seeded():
    rng = np.random.default_rng(1)
    centers = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], np.float32)
    pts = (centers[rng.integers(0, 4, 400)] + 0.1 * rng.standard_normal((400, 2))).astype(np.float32)
    c, inertia = rvq.kmeans(jax.random.key(0), pts, k=4, iters=10, restarts=3)
    got = sorted(map(tuple, np.round(np.asarray(c), 1)))
    np.testing.assert_allclose(got, sorted(map(tuple, centers)), atol=0.1)
    assert float(inertia) < 400 * 0.1
    c2, _ = rvq.kmeans(jax.random.key(0), pts, k=4, iters=10, restarts=3)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(c2))


def test_shapes_packing_and_bits(fitted):
    x, books = fitted
    assert books.c1.shape == (16, 4) and books.c2.shape == (16, 4) and books.scale.shape == (2, 64)
    p = jax.jit(rvq.encode)(x, books)
    assert p.dtype == jnp.uint8 and p.shape == (512, 2, 16)
    assert p.nbytes * 8 / x.size == 2 == bits.bits_per_element(books)
    out = jax.jit(rvq.decode)(p, books)
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rvq.decode(rvq.encode(x, books), books)))


def test_stage2_strictly_reduces_error(fitted):
    x, books = fitted
    p = rvq.encode(x, books)
    e1 = float(jnp.mean((rvq.decode(p, books, stages=1) - x) ** 2))
    e2 = float(jnp.mean((rvq.decode(p, books) - x) ** 2))
    assert e2 < 0.6 * e1, (e1, e2)  # measured e2 / e1 = 0.415
    # Stage 2 was fitted on residuals: its codewords are much smaller than stage 1's.
    assert float(jnp.linalg.norm(books.c2)) < 0.7 * float(jnp.linalg.norm(books.c1))


def test_rvq_beats_direct_int2_on_heavy_tails(fitted):
    """Measured MSE ratios (this data, seed 0): direct INT2 g=64 (2.25 bits, FP8 meta) / RVQ (2.0 bits)
    = 2.73; direct INT2 g=32 (2.5 bits) / RVQ = 1.59. Far from the notes' "order of magnitude" on
    this synthetic data, but RVQ wins with fewer bits. Asserted: > 2.0 and > 1.2."""
    x, books = fitted
    e_rvq = float(jnp.mean((rvq.decode(rvq.encode(x, books), books) - x) ** 2))
    for g, floor in ((64, 2.0), (32, 1.2)):
        e_int2 = float(jnp.mean((affine.fake_quant(x, affine.QuantConfig(2, g)) - x) ** 2))
        assert e_int2 / e_rvq > floor, (g, e_int2 / e_rvq)


def test_groups_and_scales_stay_inside_heads(fitted):
    x, books = fitted
    big = x.copy()
    big[:, 0] *= 100.0  # change head 0 only
    np.testing.assert_array_equal(np.asarray(rvq.encode(big, books))[:, 1], np.asarray(rvq.encode(x, books))[:, 1])
    s = np.asarray(rvq.channel_scale(big))
    np.testing.assert_allclose(s[0], 100 * np.asarray(books.scale)[0], rtol=1e-5)
    np.testing.assert_allclose(s[1], np.asarray(books.scale)[1], rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="n_codes"):
        rvq.fit_rvq(jax.random.key(0), np.zeros((4, 1, 8), np.float32), n_codes=32)
    with pytest.raises(ValueError, match="not divisible"):
        rvq.encode(np.zeros((2, 6), np.float32), rvq.RVQCodebooks(jnp.zeros((16, 4)), jnp.zeros((16, 4)), jnp.ones(6)))
