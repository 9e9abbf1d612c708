"""Exact storage accounting: bits per cached element and real byte counts (spec §5, A.1–A.2).

``b_eff = (1/L) * sum_r (b_r + n_meta * meta_bits / g_r) + c_alpha`` with ``n_meta = 2`` (scale and
offset; 1 for symmetric), ``c_alpha = alpha_bits * (L - 1) / (L * D)`` for least-squares residual
schemes and 0 otherwise. Rotations, key means, codebooks and padding are excluded (shared side data).
Values are ``fractions.Fraction`` so the spec's figures compare exactly (``float()`` them to print).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import jax
import numpy as np

from rq_jax.quant import affine, packing, residual, rvq


def affine_bits(cfg: affine.QuantConfig, head_dim: int | None = None) -> Fraction:
    """Bits per element of one affine quantizer: ``b + n_meta * meta_bits / g`` (16 and 0 bits: no
    metadata), plus ``16 / head_dim`` for a per-vector bfloat16 super-scale (then ``head_dim`` is required)."""
    if cfg.bits in (affine.PASSTHROUGH_BITS, affine.DROP_BITS):
        return Fraction(cfg.bits)
    n_meta = 1 if cfg.symmetric else 2
    out = cfg.bits + Fraction(n_meta * cfg.meta_bits, cfg.group_size)
    if cfg.super_scale:
        if head_dim is None:
            raise ValueError("a super-scale quantizer needs head_dim: its 16 bits are per vector")
        out += Fraction(16, head_dim)
    return out


def direct_bits(cfgs: Sequence[affine.QuantConfig], head_dim: int | None = None) -> Fraction:
    """Average bits per element of per-loop direct quantizers (e.g. [2,2,2,4] without residuals)."""
    return sum((affine_bits(c, head_dim) for c in cfgs), Fraction(0)) / len(cfgs)


def residual_bits(cfg: residual.ResidualConfig, head_dim: int) -> Fraction:
    """Bits per element of a residual loop group: per-loop codes + metadata, plus alpha if LS."""
    n = cfg.num_loops
    b = direct_bits([cfg.quant_config(r) for r in range(n)], head_dim)
    if cfg.least_squares:
        b += Fraction(cfg.alpha_dtype.itemsize * 8 * (n - 1), n * head_dim)
    return b


def rvq_bits(n_codes: int = 16, group: int = 4, stages: int = 2) -> Fraction:
    """Bits per element of RVQ with 4-bit packed indices: ``stages * 4 / group`` (2 by default)."""
    if n_codes > 16:
        raise ValueError("indices are packed in 4 bits: n_codes must be <= 16")
    return Fraction(stages * 4, group)


def bits_per_element(scheme, head_dim: int | None = None) -> Fraction:
    """Exact bits per element of a scheme.

    ``scheme``: ``affine.QuantConfig`` (direct), a sequence of them (direct, one per loop),
    ``residual.ResidualConfig`` (needs ``head_dim`` for alpha), ``rvq.RVQCodebooks`` or ``"rvq"``;
    super-scale quantizers need ``head_dim`` too.
    """
    if isinstance(scheme, affine.QuantConfig):
        return affine_bits(scheme, head_dim)
    if isinstance(scheme, residual.ResidualConfig):
        if head_dim is None:
            raise ValueError("residual schemes need head_dim for the alpha cost")
        return residual_bits(scheme, head_dim)
    if isinstance(scheme, rvq.RVQCodebooks):
        k, g = scheme.c1.shape
        return rvq_bits(k, g)
    if isinstance(scheme, str) and scheme == "rvq":
        return rvq_bits()
    if isinstance(scheme, Sequence) and all(isinstance(c, affine.QuantConfig) for c in scheme):
        return direct_bits(scheme, head_dim)
    raise TypeError(f"unsupported scheme {scheme!r}")


def _nb(a) -> int:
    return 0 if a is None else int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def stored_nbytes(obj, cfg=None) -> int:
    """Real bytes of the packed representation: codes packed with ``packing.pack`` + metadata + alpha.

    ``obj``: ``affine.Quantized`` (``cfg`` its ``QuantConfig``), ``residual.EncodedGroup`` (``cfg`` its
    ``ResidualConfig``) or an already-packed array (RVQ indices; ``cfg`` unused).
    """
    if isinstance(obj, affine.Quantized):
        packed = packing.pack(obj.codes, cfg.bits)
        return _nb(packed) + _nb(obj.scale) + _nb(obj.offset) + _nb(obj.super_scale)
    if isinstance(obj, residual.EncodedGroup):
        total = sum(stored_nbytes(q, cfg.quant_config(r)) for r, q in enumerate(obj.loops))
        return total + _nb(obj.alpha)
    if isinstance(obj, jax.Array | np.ndarray):
        return _nb(obj)
    raise TypeError(f"unsupported object {type(obj).__name__}")


def saving(bits: Fraction, baseline_bits: int = 16) -> Fraction:
    """Fraction of storage saved against ``baseline_bits`` (0.80664... for 3.09375 vs BF16)."""
    return 1 - Fraction(bits) / baseline_bits


__all__ = [
    "affine_bits",
    "bits_per_element",
    "direct_bits",
    "residual_bits",
    "rvq_bits",
    "saving",
    "stored_nbytes",
]
