"""Rotations: Hadamard (Sylvester and Paley-Kronecker), random, learned; apply/un-apply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.quant import rotation
from rq_jax.quant.rotation import hadamard, learned_rotation, make_rotation, random_orthogonal, rotate, unrotate


def _assert_orthogonal(u):
    u = np.asarray(u, np.float64)
    np.testing.assert_allclose(u @ u.T, np.eye(u.shape[0]), atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 8, 128, 12, 20, 24, 96, 36, 48])
def test_hadamard_orthogonal_pm_entries(n):
    h = np.asarray(hadamard(n))
    assert h.dtype == np.float32 and h.shape == (n, n)
    _assert_orthogonal(h)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-6)


def test_hadamard_96_is_paley12_kron_sylvester8():
    h = np.round(np.asarray(hadamard(96), np.float64) * np.sqrt(96)).astype(int)
    h12 = np.round(np.asarray(hadamard(12), np.float64) * np.sqrt(12)).astype(int)
    h8 = np.round(np.asarray(hadamard(8), np.float64) * np.sqrt(8)).astype(int)
    np.testing.assert_array_equal(h, np.kron(h12, h8))
    h24 = np.round(np.asarray(hadamard(24), np.float64) * np.sqrt(24)).astype(int)
    np.testing.assert_array_equal(h24, np.kron(h12, [[1, 1], [1, -1]]))


@pytest.mark.parametrize("n", [3, 92])
def test_no_hadamard_suggests_random(n):
    with pytest.raises(ValueError, match="random"):
        hadamard(n)


def test_random_orthogonal_seeded():
    a = random_orthogonal(jax.random.key(0), 96)
    _assert_orthogonal(a)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(random_orthogonal(jax.random.key(0), 96)))
    assert not np.allclose(np.asarray(a), np.asarray(random_orthogonal(jax.random.key(1), 96)))


def test_learned_rotation():
    base = hadamard(24)
    got = jax.jit(learned_rotation)(jnp.zeros((24, 24)), base)
    np.testing.assert_allclose(np.asarray(got), np.asarray(base), atol=1e-6)
    a = 0.3 * jax.random.normal(jax.random.key(0), (24, 24))
    t = jax.jit(learned_rotation)(a, base)
    _assert_orthogonal(t)
    g = jax.jit(jax.grad(lambda a: jnp.sum(learned_rotation(a, base)[0] ** 3)))(a)
    assert np.all(np.isfinite(np.asarray(g))) and np.abs(np.asarray(g)).max() > 0


@pytest.mark.parametrize("kind", ["identity", "hadamard", "random"])
def test_rotate_unrotate_round_trip(kind):
    u = make_rotation(kind, 96, key=jax.random.key(3))
    _assert_orthogonal(u)
    x = jax.random.normal(jax.random.key(1), (4, 2, 96))
    z = rotate(x, u)
    np.testing.assert_allclose(np.asarray(z[1, 0]), np.asarray(u) @ np.asarray(x[1, 0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(unrotate(z, u)), np.asarray(x), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(z, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_make_rotation_errors():
    with pytest.raises(ValueError, match="key"):
        make_rotation("random", 8)
    with pytest.raises(ValueError, match="unknown rotation kind"):
        make_rotation("optr", 8)
    assert rotation.ROTATION_KINDS == ("identity", "hadamard", "random")
