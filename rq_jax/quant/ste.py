"""Straight-through estimators (STE) for every quantizer in ``rq_jax.quant``.

The forward value is *exactly* the quantizer's encode→decode output (bit for bit). The usual
``x + stop_gradient(q - x)`` is not bit-exact in floating point (``x + (q - x) != q`` in general),
so the STE is a ``jax.custom_jvp`` whose primal output is ``q`` and whose tangent is ``dx * mask``.
It works under ``jit``, ``vmap``, ``grad`` and ``jvp``. No gradient reaches metadata, codebooks,
alphas or references (they are treated as constants, spec §4: "stopped through the references").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rq_jax.quant import affine, residual, rvq


@jax.custom_jvp
def straight_through(x: jax.Array, q: jax.Array, mask: jax.Array) -> jax.Array:
    """Return ``q`` (same shape as ``x``); the derivative w.r.t. ``x`` is ``diag(mask)``.

    ``mask`` is a float array broadcastable to ``x`` (1 = pass, 0 = block). ``q`` and ``mask``
    receive no gradient.
    """
    del x, mask
    return q


@straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    x, q, mask = primals
    dx = tangents[0]
    return q, (dx * mask).astype(q.dtype)


def _out_dtype(x):
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def ste_fake_quant(x: jax.Array, cfg: affine.QuantConfig, mask_clipped: bool = True) -> jax.Array:
    """Affine fake quantization ``[..., D] -> [..., D]`` (dtype of ``x``) with an STE.

    Gradient is the identity inside each group's clip interval (``affine.clip_range``) and zero for
    elements the clip factor cut off when ``mask_clipped``; with ``clip = 1`` it is the identity.
    """
    q = jax.lax.stop_gradient(affine.fake_quant(x, cfg, dtype=_out_dtype(x)))
    if mask_clipped:
        xs = jax.lax.stop_gradient(x).astype(jnp.float32)
        lo, hi = affine.clip_range(xs, cfg)
        xg = xs.reshape(*xs.shape[:-1], -1, cfg.group_size)
        inside = (xg >= lo[..., None]) & (xg <= hi[..., None])
        mask = inside.reshape(xs.shape).astype(q.dtype)
    else:
        mask = jnp.ones((), q.dtype)
    return straight_through(x.astype(q.dtype), q, mask)


def ste_rvq(x: jax.Array, books: rvq.RVQCodebooks) -> jax.Array:
    """RVQ encode→decode ``[..., D] -> [..., D]`` float32 with an identity STE w.r.t. ``x``."""
    q = jax.lax.stop_gradient(rvq.decode(rvq.encode(x, books), books))
    return straight_through(x.astype(q.dtype), q, jnp.ones((), q.dtype))


def ste_residual_group(
    z: jax.Array, cfg: residual.ResidualConfig, mean: jax.Array | None = None
) -> jax.Array:
    """Residual group encode→decode ``[L, ..., D] -> [L, ..., D]`` f32 with an identity STE in ``z``.

    Each loop's reconstruction passes gradient only to that loop's input (references stopped).
    """
    q = jax.lax.stop_gradient(residual.decode_group(residual.encode_group(z, cfg, mean), cfg, mean))
    return straight_through(z.astype(q.dtype), q, jnp.ones((), q.dtype))
