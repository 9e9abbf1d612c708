"""Affine group quantization along the last axis (INT1/2/3/4/8).

A vector ``x [..., D]`` is split into ``G = D // g`` groups of ``g`` consecutive channels. Each group
gets its own metadata, stored in a low-precision float (``meta_dtype``: float8_e4m3fn by default,
bfloat16, float16 or float32), and every channel an unsigned ``b``-bit code kept *unpacked* in a
uint8 (``packing.pack`` packs them).

Asymmetric (the ResidualQuant quantizer, spec §5; all ``2**b`` levels used)::

    lo, hi = min(group), max(group)
    mid    = (hi + lo) / 2 ;  rad = (hi - lo) / 2 * clip          # clip: 0.9 at 2 bits, else 1.0
    offset = meta(clamp(mid - rad, -M, M))                       # M: finite max of meta dtype
    scale  = meta(min(2 * rad / (2**b - 1), M))
    u      = (x - offset) / (scale if scale > 0 else 1)
    code   = clamp(floor(u) + (u - floor(u) > 0.5), 0, 2**b - 1)  # round half DOWN
    x_hat  = offset + scale * code

At ``clip = 1`` the offset is ``lo`` itself (what ``mid - rad`` equals exactly; formed in float32 it
could be an ulp off) and ``2 * rad`` is ``hi - lo``, so the metadata are KIVI's: zero-point = group
minimum, ``scale = (max - min) / (2**b - 1)``.

Symmetric (baselines; the signed grid ``{-qmax..qmax} * scale``, ``qmax = 2**(b-1) - 1``, so INT2
uses three levels; needs ``b >= 2``)::

    scale  = meta(min(max|group| * clip / qmax, M))
    code   = clamp(round_half_down(x / (scale if scale > 0 else 1)), -qmax, qmax) + 2**(b-1)
    x_hat  = scale * (code - 2**(b-1))

For symmetric configs ``Quantized.offset`` is ``None``: the offset ``-2**(b-1) * scale`` is implied
and not stored (it would overflow fp8 at 8 bits).

``bits=0`` stores nothing: no codes, no metadata, and every value reconstructs to 0 — a residual loop
that keeps only its least-squares scale, reading its reference scaled (the "0-bit residual" of loop
sharing).

``bits=16`` is the identity setting: ``codes`` hold the values in bfloat16 and there is no metadata
(``scale``/``offset`` have ``G = 0`` columns), so schemes built on this module (residual groups,
cache formats) can run losslessly up to bfloat16 rounding.

``rounding`` picks the rule at exact ties: ``"half_down"`` (the spec's, above; default) or
``"half_even"`` (``torch.round``'s, which KIVI uses).

All arithmetic is float32, with the metadata cast to ``meta_dtype`` and back before the codes are
computed, so ``dequantize`` is the exact inverse arithmetic of the encoder. Every operation of the
encoder is rounded as written, also under ``jax.jit``: left alone, XLA rewrites a division by a
broadcast scale into a multiply by its reciprocal (u = 1.5 becomes 1.5000001 and rounds up) and
contracts ``mid - clip * rad`` into one fused multiply-add (an exact FP8 midpoint then rounds the other
way). So every divisor passes through ``jax.lax.optimization_barrier`` (the simplifier cannot see a
broadcast or a constant behind it) and the clipped radius through a clamp to the finite float32 range
(an identity for finite values that no compiler can drop, and that separates the multiply from the
subtraction): the codes and metadata at exact ties are the same jitted and un-jitted.

Metadata range. E4M3 spans 2**-9 .. 448, so a group whose offset or scale lies outside it saturates
or flushes to zero. ``out_of_range(x, cfg)`` counts such metadata per vector (it is what the caches
report), and ``super_scale=True`` is the second metadata option, as NVFP4/MX formats do: each vector
``[..., D]`` also stores a bfloat16 super-scale ``S = bf16(m / 256)`` (``m`` the largest ``|offset|``
or ``scale`` of its groups; 1 when ``m`` is 0), and the stored offsets and scales are ``meta(v / S)``;
reconstruction multiplies them back (``S * o`` and ``S * s`` are exact in float32). It costs 16 bits
per vector (``bits.affine_bits`` counts it) and keeps each vector's metadata inside the dtype's range
whatever its magnitude; groups more than ~2**17 below their vector's largest still flush to zero
(and are counted).

Non-finite inputs never reach finite neighbours: a group's range is taken over its finite values,
+inf stores the top code and -inf the bottom one (they reconstruct as the group's clip values), NaN
the code of u = 0 (the offset; zero when symmetric), and ``out_of_range`` counts each such value.

Midpoint and radius are formed as ``hi/2 ± lo/2`` (equal to the spec's formulas, but no float32
overflow for huge inputs). A group whose scale underflows to zero in the metadata dtype (e.g. a range below
2**-10 in fp8)
reconstructs to its offset: never NaN. Inputs with ``|x| <= 1e38`` give finite outputs for every
metadata dtype (beyond that, float32 and bfloat16 metadata can overflow ``scale * code``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

VALID_BITS = (0, 1, 2, 3, 4, 8, 16)
PASSTHROUGH_BITS = 16  # "16 bits": no quantization, values kept in bfloat16 with no metadata
DROP_BITS = 0  # "0 bits": nothing stored, every value reconstructs to 0
META_DTYPES = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float16),
    np.dtype(jnp.float32),
)
ROUNDINGS = ("half_down", "half_even")  # the spec's rule at exact ties; torch.round's (KIVI)


def default_clip(bits: int) -> float:
    """The spec's clipping factor for a bit width: 0.9 at INT2, 1.0 otherwise."""
    return 0.9 if bits == 2 else 1.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """One affine quantizer: bit width, group size, symmetry, metadata dtype, clip factor and tie rule.

    Frozen and hashable, so it can be a static argument of ``jax.jit``. ``meta_dtype`` is normalised
    to a ``numpy.dtype``; ``clip=None`` means the spec default (``default_clip(bits)``); ``rounding``
    is one of ``ROUNDINGS`` (``"half_down"``, the spec's, by default); ``super_scale`` stores the
    metadata relative to a per-vector bfloat16 super-scale (see the module docstring).
    """

    bits: int
    group_size: int
    symmetric: bool = False
    meta_dtype: object = jnp.float8_e4m3fn
    clip: float | None = None
    rounding: str = "half_down"
    super_scale: bool = False

    def __post_init__(self):
        if self.bits not in VALID_BITS:
            raise ValueError(f"invalid bit width {self.bits!r}: expected one of {VALID_BITS}")
        if not isinstance(self.group_size, (int, np.integer)) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")
        if self.symmetric and self.bits < 2:
            raise ValueError("symmetric quantization needs bits >= 2 (INT1 symmetric has one level)")
        try:
            dt = np.dtype(self.meta_dtype)
        except TypeError as e:
            raise ValueError(f"unsupported meta dtype {self.meta_dtype!r}") from e
        if dt not in META_DTYPES:
            raise ValueError(
                f"unsupported meta dtype {dt}: expected one of {[str(d) for d in META_DTYPES]}"
            )
        object.__setattr__(self, "meta_dtype", dt)
        if self.clip is not None and not (0.0 < float(self.clip) <= 1.0):
            raise ValueError(f"clip must lie in (0, 1], got {self.clip!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    @property
    def clip_factor(self) -> float:
        """The clip factor actually applied (``clip`` or the per-bit default)."""
        return default_clip(self.bits) if self.clip is None else float(self.clip)

    @property
    def levels(self) -> int:
        """Number of code values, ``2**bits``."""
        return 1 << self.bits

    @property
    def meta_max(self) -> float:
        """Largest finite value of the metadata dtype (448 for float8_e4m3fn)."""
        return float(jnp.finfo(self.meta_dtype).max)

    @property
    def meta_bits(self) -> int:
        """Bits of one metadata value."""
        return self.meta_dtype.itemsize * 8


class Quantized(NamedTuple):
    """Codes and metadata of an affine-quantized tensor (a pytree).

    codes:  uint8 ``[..., D]``, unpacked, values in ``[0, 2**bits)``.
    scale:  ``[..., D // g]`` in ``meta_dtype`` (relative to ``super_scale`` when there is one).
    offset: ``[..., D // g]`` in ``meta_dtype``; ``None`` for symmetric configs (implied).
    super_scale: bfloat16 ``[..., 1]`` with ``cfg.super_scale``, else ``None``.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    super_scale: jax.Array | None = None


def _groups(x: jax.Array, g: int) -> jax.Array:
    d = x.shape[-1]
    if d % g != 0:
        raise ValueError(f"last dimension D={d} is not divisible by group size g={g}")
    return x.reshape(*x.shape[:-1], d // g, g)


def round_half_down(u: jax.Array) -> jax.Array:
    """Round to nearest, ties toward -inf: ``floor(u) + (u - floor(u) > 0.5)`` (elementwise)."""
    f = jnp.floor(u)
    return f + (u - f > 0.5).astype(u.dtype)


def _round(u: jax.Array, cfg: QuantConfig) -> jax.Array:
    """``u`` rounded to an integer by the config's tie rule."""
    return round_half_down(u) if cfg.rounding == "half_down" else jnp.round(u)  # jnp.round: half to even


def exact_divisor(x: jax.Array | float, shape: tuple[int, ...] | None = None) -> jax.Array:
    """``x`` (broadcast to ``shape``) as a divisor XLA cannot see into: behind an optimization barrier
    its algebraic simplifier (which runs before barriers are expanded) cannot rewrite a division by it
    into a multiply by its reciprocal."""
    x = jnp.asarray(x, jnp.float32)
    return jax.lax.optimization_barrier(x if shape is None else jnp.broadcast_to(x, shape))


def unfused(product: jax.Array) -> jax.Array:
    """A product kept rounded to float32 before any later add: clamped to the finite float32 range,
    which no compiler can drop (it maps ±inf) and which sits between the multiply and the add, so
    they cannot be contracted into a fused multiply-add (an optimization barrier does not stop that:
    XLA expands barriers before it fuses)."""
    big = float(jnp.finfo(jnp.float32).max)
    return jnp.clip(product, -big, big)


def _to_meta(v: jax.Array, cfg: QuantConfig) -> jax.Array:
    m = cfg.meta_max
    return jnp.clip(v, -m, m).astype(cfg.meta_dtype)


class _Meta(NamedTuple):
    """The encoder's metadata of ``x`` grouped ``[..., G, g]``: float32 values before and after the
    cast to the metadata dtype (relative to the super-scale when there is one), and the super-scale."""

    raw: tuple[jax.Array, ...]  # (scale,) or (scale, offset), each [..., G]
    stored: tuple[jax.Array, ...]
    super_scale: jax.Array | None  # [..., 1] float32 (bfloat16 values)


def _metadata(xg: jax.Array, cfg: QuantConfig) -> _Meta:
    finite = jnp.isfinite(xg)
    clip = cfg.clip_factor
    if cfg.symmetric:
        qmax = (1 << (cfg.bits - 1)) - 1
        amax = jnp.max(jnp.where(finite, jnp.abs(xg), 0.0), axis=-1) * clip
        raw = (amax / exact_divisor(qmax, amax.shape),)
    else:
        lo = jnp.min(jnp.where(finite, xg, jnp.inf), axis=-1)
        hi = jnp.max(jnp.where(finite, xg, -jnp.inf), axis=-1)
        lo, hi = jnp.where(lo <= hi, lo, 0.0), jnp.where(lo <= hi, hi, 0.0)  # no finite value: [0, 0]
        if clip == 1.0:  # mid - rad is lo exactly: take it as it is (KIVI's zero-point)
            rad, low = hi / 2 - lo / 2, lo
        else:
            rad = unfused((hi / 2 - lo / 2) * clip)  # rounded before the subtraction
            low = (hi / 2 + lo / 2) - rad
        raw = (2 * rad / exact_divisor(cfg.levels - 1, rad.shape), low)
    sup = None
    if cfg.super_scale:
        m = jnp.max(jnp.stack([jnp.abs(r) for r in raw]), axis=(0, -1))[..., None]
        sup = jnp.where(m > 0, m / 256, 1.0).astype(jnp.bfloat16).astype(jnp.float32)
        sup = jnp.where(sup > 0, sup, 1.0)  # a super-scale underflowing bfloat16
        raw = tuple(r / exact_divisor(sup, r.shape) for r in raw)
    return _Meta(raw, tuple(_to_meta(r, cfg) for r in raw), sup)


def quantize(x: jax.Array, cfg: QuantConfig) -> Quantized:
    """Quantize ``x [..., D]`` group-wise along the last axis.

    Returns ``Quantized(codes uint8 [..., D], scale [..., D//g], offset [..., D//g] | None,
    super_scale [..., 1] | None)`` (16 bits: bfloat16 codes and empty ``[..., 0]`` metadata; 0 bits: zero
    codes and empty metadata). Raises
    ValueError when ``D % cfg.group_size != 0``.
    """
    xg = _groups(jnp.asarray(x, jnp.float32), cfg.group_size)  # [..., G, g]
    if cfg.bits in (PASSTHROUGH_BITS, DROP_BITS):
        empty = jnp.zeros(x.shape[:-1] + (0,), cfg.meta_dtype)
        codes = xg.reshape(x.shape).astype(jnp.bfloat16) if cfg.bits else jnp.zeros(x.shape, jnp.uint8)
        return Quantized(codes, empty, None if cfg.symmetric else empty)
    meta = _metadata(xg, cfg)
    sup = None if meta.super_scale is None else meta.super_scale.astype(jnp.bfloat16)
    s, o = _effective(meta.stored, meta.super_scale)
    if cfg.symmetric:
        qmax = (1 << (cfg.bits - 1)) - 1
        u = xg / exact_divisor(jnp.where(s > 0, s, 1.0)[..., None], xg.shape)
        u = jnp.nan_to_num(u, nan=0.0)
        c = jnp.clip(_round(u, cfg), -qmax, qmax) + (1 << (cfg.bits - 1))
        return Quantized(c.astype(jnp.uint8).reshape(x.shape), meta.stored[0], None, sup)
    u = (xg - o[..., None]) / exact_divisor(jnp.where(s > 0, s, 1.0)[..., None], xg.shape)
    u = jnp.nan_to_num(u, nan=0.0)
    c = jnp.clip(_round(u, cfg), 0, cfg.levels - 1)
    return Quantized(c.astype(jnp.uint8).reshape(x.shape), meta.stored[0], meta.stored[1], sup)


def _effective(stored, sup) -> tuple[jax.Array, jax.Array | None]:
    """Float32 scale and offset ``[..., G]`` as the reconstruction uses them (super-scale applied:
    a bfloat16 times an fp8/bf16 value is exact in float32)."""
    vals = [v.astype(jnp.float32) for v in stored]
    if sup is not None:
        vals = [v * sup.astype(jnp.float32) for v in vals]
    return vals[0], (vals[1] if len(vals) > 1 else None)


def out_of_range(x: jax.Array, cfg: QuantConfig) -> jax.Array:
    """Per vector ``[...]`` (int32): metadata values of ``x [..., D]``'s groups that ``quantize`` could
    not store — saturated beyond the dtype's finite range or flushed to zero from a non-zero value —
    plus non-finite entries of ``x``. Only those at 16 and 0 bits (no metadata)."""
    xg = _groups(jnp.asarray(x, jnp.float32), cfg.group_size)
    bad = jnp.sum(~jnp.isfinite(xg), axis=(-2, -1))
    if cfg.bits in (PASSTHROUGH_BITS, DROP_BITS):
        return bad.astype(jnp.int32)
    meta = _metadata(xg, cfg)
    for raw, stored in zip(meta.raw, meta.stored):
        lost = (jnp.abs(raw) > cfg.meta_max) | ((raw != 0) & (stored.astype(jnp.float32) == 0))
        bad = bad + jnp.sum(lost, axis=-1)
    return bad.astype(jnp.int32)


def dequantize(q: Quantized, cfg: QuantConfig, dtype=jnp.float32) -> jax.Array:
    """Reconstruct ``[..., D]`` from ``Quantized``: ``offset + scale * code`` in float32, then cast (0 bits:
    zeros)."""
    if cfg.bits == PASSTHROUGH_BITS:
        return q.codes.astype(jnp.float32).astype(dtype)
    if cfg.bits == DROP_BITS:
        return jnp.zeros(q.codes.shape, dtype)
    c = _groups(q.codes, cfg.group_size).astype(jnp.float32)  # [..., G, g]
    s, o = _effective((q.scale,) if cfg.symmetric else (q.scale, q.offset), q.super_scale)
    if cfg.symmetric:
        xh = s[..., None] * (c - float(1 << (cfg.bits - 1)))
    else:
        xh = o[..., None] + s[..., None] * c
    return xh.reshape(q.codes.shape).astype(dtype)


def fake_quant(x: jax.Array, cfg: QuantConfig, dtype=jnp.float32) -> jax.Array:
    """``dequantize(quantize(x))``: ``[..., D] -> [..., D]``."""
    return dequantize(quantize(x, cfg), cfg, dtype)


def clip_range(x: jax.Array, cfg: QuantConfig) -> tuple[jax.Array, jax.Array]:
    """Float32 clipping interval per group, before metadata rounding: ``([..., G], [..., G])``.

    Asymmetric: ``mid ± rad``; symmetric: ``±clip * max|x|``. Used by the STE to mask gradients.
    """
    xg = _groups(jnp.asarray(x, jnp.float32), cfg.group_size)
    if cfg.symmetric:
        a = jnp.max(jnp.abs(xg), axis=-1) * cfg.clip_factor
        return -a, a
    lo = jnp.min(xg, axis=-1)
    hi = jnp.max(xg, axis=-1)
    if cfg.clip_factor == 1.0:
        return lo, hi  # exact: mid ± rad can round inside [lo, hi]
    mid = hi / 2 + lo / 2
    rad = (hi / 2 - lo / 2) * cfg.clip_factor
    return mid - rad, mid + rad
