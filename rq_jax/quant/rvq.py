"""Two-stage residual vector quantization (RVQ) of head vectors, 2 bits per element (RVQ.md).

Encoding of ``x [..., H, D]`` with per-channel scales ``scale [H, D]`` (fixed, from calibration):
normalise ``y = x / scale``; split each head vector into groups of ``group = 4`` consecutive channels
(``D % 4 == 0``, so a group never crosses a head); stage 1 picks the nearest codeword of ``c1 [16, 4]``;
stage 2 the nearest codeword of ``c2 [16, 4]`` for the stage-1 residual. Both 4-bit indices go in one
byte per group: ``packed = idx1 | (idx2 << 4)``, uint8 ``[..., H, D // 4]`` (8 bits / 4 elements).
Decoding is two look-ups and an add: ``x_hat = (c1[idx1] + c2[idx2]) * scale``.

Fitting: k-means (k-means++ init, restarts, fixed seed) for ``c1`` on the normalised groups of all
heads; then, with ``c1`` frozen, ``c2`` on the stage-1 residuals only. One codebook pair is shared by
all heads (heads differ mostly in magnitude, which the per-channel scales carry).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class RVQCodebooks(NamedTuple):
    """Codebooks and scales (pytree): ``c1 [K, d]``, ``c2 [K, d]`` (K <= 16 codes of d channels),
    ``scale`` per channel, broadcastable against the data (``[H, D]`` from ``fit_rvq``)."""

    c1: jax.Array
    c2: jax.Array
    scale: jax.Array


def _sq_dist(points: jax.Array, centers: jax.Array) -> jax.Array:
    """``[..., d], [k, d] -> [..., k]`` squared Euclidean distances."""
    return jnp.sum(jnp.square(points[..., None, :] - centers), axis=-1)


def _kmeans_pp(key: jax.Array, points: jax.Array, k: int) -> jax.Array:
    n = points.shape[0]
    k0, key = jax.random.split(key)
    first = points[jax.random.randint(k0, (), 0, n)]
    centers = jnp.zeros((k, points.shape[1]), points.dtype).at[0].set(first)
    d2 = jnp.sum(jnp.square(points - first), axis=-1)

    def body(i, state):
        centers, d2, key = state
        key, sub = jax.random.split(key)
        tot = jnp.sum(d2)
        logits = jnp.where(tot > 0, jnp.log(jnp.maximum(d2, 0.0)), 0.0)
        c = points[jax.random.categorical(sub, logits)]
        centers = centers.at[i].set(c)
        d2 = jnp.minimum(d2, jnp.sum(jnp.square(points - c), axis=-1))
        return centers, d2, key

    centers, _, _ = jax.lax.fori_loop(1, k, body, (centers, d2, key))
    return centers


def _lloyd(points: jax.Array, centers: jax.Array, iters: int) -> tuple[jax.Array, jax.Array]:
    def step(centers, _):
        assign = jnp.argmin(_sq_dist(points, centers), axis=-1)
        onehot = jax.nn.one_hot(assign, centers.shape[0], dtype=points.dtype)  # [N, k]
        counts = onehot.sum(0)
        sums = onehot.T @ points
        new = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], centers)
        return new, None

    centers, _ = jax.lax.scan(step, centers, None, length=iters)
    inertia = jnp.sum(jnp.min(_sq_dist(points, centers), axis=-1))
    return centers, inertia


@functools.partial(jax.jit, static_argnames=("k", "iters", "restarts"))
def kmeans(
    key: jax.Array, points: jax.Array, k: int, iters: int = 25, restarts: int = 4
) -> tuple[jax.Array, jax.Array]:
    """k-means of ``points [N, d]``: k-means++ init, ``iters`` Lloyd steps, best of ``restarts``.

    Returns ``(centers [k, d], inertia [])`` (sum of squared distances). Deterministic in ``key``.
    Empty clusters keep their previous center.
    """
    points = jnp.asarray(points, jnp.float32)

    def one(key):
        return _lloyd(points, _kmeans_pp(key, points, k), iters)

    centers, inertia = jax.vmap(one)(jax.random.split(key, restarts))
    best = jnp.argmin(inertia)
    return centers[best], inertia[best]


def channel_scale(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Per-channel RMS over all but the last two axes: ``[..., H, D] -> [H, D]`` (zeros -> 1)."""
    x = jnp.asarray(x, jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=tuple(range(x.ndim - 2))))
    return jnp.where(rms > eps, rms, 1.0)


def _split(y: jax.Array, group: int) -> jax.Array:
    d = y.shape[-1]
    if d % group:
        raise ValueError(f"head dim D={d} is not divisible by the RVQ group {group}")
    return y.reshape(*y.shape[:-1], d // group, group)


def fit_rvq(
    key: jax.Array,
    x: jax.Array,
    n_codes: int = 16,
    group: int = 4,
    restarts: int = 4,
    iters: int = 25,
) -> RVQCodebooks:
    """Fit a 2-stage RVQ on calibration states ``x [N, H, D]`` (any leading axes before ``H``).

    Scales are per (head, channel): ``scale [H, D]``. Stage 2 is fitted on stage-1 residuals with
    stage 1 frozen. ``n_codes <= 16`` (indices are packed as 4 bits).
    """
    if not 1 <= n_codes <= 16:
        raise ValueError(f"n_codes must be in [1, 16] for 4-bit indices, got {n_codes}")
    x = jnp.asarray(x, jnp.float32)
    if x.ndim < 3:
        raise ValueError(f"fit_rvq expects x [N, H, D], got shape {x.shape}")
    scale = channel_scale(x)
    pts = _split(x / scale, group).reshape(-1, group)
    k1, k2 = jax.random.split(key)
    c1, _ = kmeans(k1, pts, n_codes, iters, restarts)
    res = pts - c1[jnp.argmin(_sq_dist(pts, c1), axis=-1)]
    c2, _ = kmeans(k2, res, n_codes, iters, restarts)
    return RVQCodebooks(c1, c2, scale)


def encode(x: jax.Array, books: RVQCodebooks) -> jax.Array:
    """``x [..., D]`` (scale broadcastable to it) -> packed indices uint8 ``[..., D // group]``."""
    y = _split(jnp.asarray(x, jnp.float32) / books.scale, books.c1.shape[-1])
    i1 = jnp.argmin(_sq_dist(y, books.c1), axis=-1)
    r = y - books.c1[i1]
    i2 = jnp.argmin(_sq_dist(r, books.c2), axis=-1)
    return (i1.astype(jnp.uint8) & 15) | (i2.astype(jnp.uint8) << 4)


def decode(packed: jax.Array, books: RVQCodebooks, stages: int = 2) -> jax.Array:
    """Packed indices uint8 ``[..., D // group]`` -> float32 ``[..., D]``; ``stages=1`` drops stage 2."""
    g = books.c1.shape[-1]
    y = books.c1[packed & 15]
    if stages == 2:
        y = y + books.c2[packed >> 4]
    y = y.reshape(*packed.shape[:-1], packed.shape[-1] * g)
    return y * books.scale
