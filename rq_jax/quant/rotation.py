"""Orthogonal rotations of head vectors: Hadamard, random, learned (OptR-H).

Convention (spec §1, column convention): a rotation ``u [D, D]`` maps a column vector ``x`` to
``z = u x``. For row-stacked data ``x [..., D]`` that is ``rotate(x, u) = x @ u.T`` and
``unrotate(z, u) = z @ u``. The paper's row-convention ``T`` (applied as ``X T``) is ``u.T``.

Hadamard matrices: Sylvester for powers of two; otherwise ``H_m ⊗ H_{2^k}`` where ``H_m`` is a Paley
Hadamard matrix computed from quadratic residues modulo a prime ``q`` (Paley I: ``m = q + 1``,
``q ≡ 3 mod 4``; Paley II: ``m = 2(q + 1)``, ``q ≡ 1 mod 4``), choosing the largest power of two.
So 96 = H_12 ⊗ H_8 and 24 = H_12 ⊗ H_2 (12 = 11 + 1, 20 = 19 + 1). Sizes with no such construction
raise a ValueError that points at ``make_rotation("random", ...)``. All are normalised by 1/sqrt(n).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ROTATION_KINDS = ("identity", "hadamard", "random")


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % p for p in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[i, j] = chi(j - i)`` with chi the quadratic character mod prime ``q`` (chi(0) = 0)."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)], np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley(m: int) -> np.ndarray | None:
    """An unnormalised ±1 Hadamard matrix of order ``m`` from a Paley construction, or None."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: H = I + S, S skew with core Q
        s = np.zeros((m, m), np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = _jacobsthal(q)
        return np.eye(m, dtype=np.int64) + s
    if m % 2 == 0:
        q = m // 2 - 1
        if _is_prime(q) and q % 4 == 1:  # Paley II: C symmetric conference matrix
            c = np.zeros((m // 2, m // 2), np.int64)
            c[0, 1:] = 1
            c[1:, 0] = 1
            c[1:, 1:] = _jacobsthal(q)
            a = np.array([[1, -1], [-1, -1]], np.int64)
            b = np.array([[1, 1], [1, -1]], np.int64)
            return np.kron(c, a) + np.kron(np.eye(m // 2, dtype=np.int64), b)
    return None


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=None)
def _hadamard_int(n: int) -> np.ndarray:
    if n < 1:
        raise ValueError(f"Hadamard size must be positive, got {n}")
    p = 1
    while n % (2 * p) == 0:
        p *= 2
    # Try the largest power-of-two factor first (smallest Paley core).
    while p >= 1:
        m = n // p
        core = np.ones((1, 1), np.int64) if m == 1 else _paley(m)
        if core is not None:
            h = np.kron(core, _sylvester(p))
            if not np.array_equal(h @ h.T, n * np.eye(n, dtype=np.int64)):  # pragma: no cover
                raise AssertionError(f"internal error: Hadamard construction failed for n={n}")
            h.setflags(write=False)
            return h
        p //= 2
    raise ValueError(
        f"no Hadamard construction available for n={n} (needs n = 2^k * m with m = q+1, q prime "
        f"≡ 3 mod 4, or m = 2(q+1), q prime ≡ 1 mod 4); use make_rotation('random', {n}, key) "
        "for a seeded random orthogonal matrix instead"
    )


def hadamard(n: int, dtype=jnp.float32) -> jax.Array:
    """Normalised (orthogonal) Hadamard matrix ``[n, n]``; entries ``±1/sqrt(n)``.

    Sylvester for powers of two, else Paley ⊗ Sylvester (see module docstring); ValueError if none.
    """
    h = _hadamard_int(int(n)).astype(np.float64) / np.sqrt(n)
    return jnp.asarray(h, dtype)


def random_orthogonal(key: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """Haar-distributed random orthogonal matrix ``[n, n]`` from ``key`` (QR with sign fix)."""
    a = jax.random.normal(key, (n, n), jnp.float32)
    q, r = jnp.linalg.qr(a)
    q = q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0)[None, :]
    return q.astype(dtype)


def learned_rotation(a: jax.Array, base: jax.Array) -> jax.Array:
    """OptR-H parametrisation ``base @ expm(a - a.T)``: ``a [n, n]`` trainable, ``base [n, n]``.

    Orthogonal for any ``a`` when ``base`` is; equals ``base`` at ``a = 0``. With ``base`` = the
    normalised Hadamard this is the paper's row-convention ``T = H·exp(A − Aᵀ)``; pass ``T.T`` as
    ``u`` to ``rotate`` to apply it as ``x @ T``. Differentiable in ``a``.
    """
    a = a.astype(jnp.float32)
    return base.astype(jnp.float32) @ jax.scipy.linalg.expm(a - a.T)


def rotate(x: jax.Array, u: jax.Array) -> jax.Array:
    """``z = u x`` per vector: ``x [..., D]``, ``u [D, D]`` -> ``[..., D]`` (float32 accumulation)."""
    return jnp.matmul(
        x, u.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def unrotate(z: jax.Array, u: jax.Array) -> jax.Array:
    """``x = uᵀ z`` per vector: ``z [..., D]``, ``u [D, D]`` -> ``[..., D]`` (float32 accumulation)."""
    return jnp.matmul(z, u, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def make_rotation(kind: str, n: int, key: jax.Array | None = None, dtype=jnp.float32) -> jax.Array:
    """Build a ``[n, n]`` rotation: ``"identity"``, ``"hadamard"`` or ``"random"`` (needs ``key``)."""
    if kind == "identity":
        return jnp.eye(n, dtype=dtype)
    if kind == "hadamard":
        return hadamard(n, dtype)
    if kind == "random":
        if key is None:
            raise ValueError("make_rotation('random', ...) needs a PRNG key")
        return random_orthogonal(key, n, dtype)
    raise ValueError(f"unknown rotation kind {kind!r}: expected one of {ROTATION_KINDS}")
