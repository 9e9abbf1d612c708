"""Loop-group residual quantization with least-squares scaling (ResidualQuant, spec §2–§4).

A group of ``L`` loops ``z [L, ..., D]`` (already rotated) is coded as one anchor plus ``L - 1``
residuals, each against a *reconstructed* reference so the decoder can rebuild it exactly::

    anchor a:  c_a = Q_a(z_a - mu_a);                  zh_a = D_a(c_a) + mu_a
    loop r:    R   = zh_{p(r)};  alpha_r = bf16(<z_r, R> / |R|^2)   (1 if least_squares is off)
               c_r = Q_r(z_r - alpha_r R - mu_r);      zh_r = alpha_r R + D_r(c_r) + mu_r

Reference policies ``p(r)``: "last" (anchor L-1, p = L-1), "first" (anchor 0, p = 0), "previous"
(anchor 0, p = r-1, chained), "next" (anchor L-1, p = r+1, chained). ``mu`` are optional per-loop
key means (pass None for values). All reconstruction arithmetic is float32 (the paper's kernels use a
BF16 predictor). Encoder and decoder run the same operations in the same order, with alpha rounded to
``alpha_dtype`` first, so they agree bit for bit when evaluated op by op; under separate ``jit``
compilations XLA may contract ``a * b + c`` into a fused multiply-add differently, which can move a
reconstruction by one float32 ulp (harmless: the error does not grow along a chain).

Storage: per loop one ``affine.Quantized``; ``alpha [L-1, ...]`` in ``alpha_dtype`` for the
non-anchor loops in increasing loop order (the anchor has no alpha), or ``None`` when least squares
is off (alpha = 1 is implied and not stored).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rq_jax.quant import affine

REFERENCES = ("last", "first", "previous", "next")


@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    """Per-group residual scheme: per-loop bits and group sizes, metadata/alpha dtypes, policy.

    ``bits``: one width per loop, e.g. ``(2, 2, 2, 4)``; ``group_sizes``: an int for every loop or one
    per loop; ``clip``: None for the per-bit default (0.9 at INT2); ``super_scale``: metadata relative
    to a per-vector bfloat16 super-scale (``affine``). Frozen/hashable (jit static).
    """

    bits: tuple[int, ...]
    group_sizes: tuple[int, ...] | int = 32
    meta_dtype: object = jnp.float8_e4m3fn
    alpha_dtype: object = jnp.bfloat16
    least_squares: bool = True
    reference: str = "last"
    clip: float | None = None
    super_scale: bool = False

    def __post_init__(self):
        bits = tuple(int(b) for b in self.bits)
        if not bits:
            raise ValueError("ResidualConfig.bits must name at least one loop")
        gs = self.group_sizes
        gs = (int(gs),) * len(bits) if isinstance(gs, (int, np.integer)) else tuple(int(g) for g in gs)
        if len(gs) != len(bits):
            raise ValueError(f"group_sizes {gs} must have one entry per loop (bits {bits})")
        if self.reference not in REFERENCES:
            raise ValueError(f"unknown reference policy {self.reference!r}: expected {REFERENCES}")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "group_sizes", gs)
        object.__setattr__(self, "alpha_dtype", np.dtype(self.alpha_dtype))
        # Validates bits, group sizes, meta dtype and clip for every loop.
        qcs = tuple(
            affine.QuantConfig(b, g, meta_dtype=self.meta_dtype, clip=self.clip, super_scale=self.super_scale)
            for b, g in zip(bits, gs)
        )
        object.__setattr__(self, "meta_dtype", qcs[0].meta_dtype)
        if bits[self.anchor] == affine.DROP_BITS:
            raise ValueError(f"bits {bits}: the anchor (loop {self.anchor}) cannot store 0 bits; only a residual "
                             "loop can (it then reads its reference, scaled)")

    @property
    def num_loops(self) -> int:
        """Loops in the group, ``L``."""
        return len(self.bits)

    @property
    def anchor(self) -> int:
        """Index of the anchor loop: ``L-1`` for "last"/"next", ``0`` for "first"/"previous"."""
        return self.num_loops - 1 if self.reference in ("last", "next") else 0

    def quant_config(self, loop: int) -> affine.QuantConfig:
        """The affine quantizer of one loop."""
        return affine.QuantConfig(
            self.bits[loop], self.group_sizes[loop], meta_dtype=self.meta_dtype, clip=self.clip,
            super_scale=self.super_scale,
        )

    def parent(self, loop: int) -> int:
        """Reference loop ``p(r)`` of a non-anchor loop."""
        if loop == self.anchor:
            raise ValueError(f"loop {loop} is the anchor and has no reference")
        return {
            "last": self.anchor,
            "first": self.anchor,
            "previous": loop - 1,
            "next": loop + 1,
        }[self.reference]

    def alpha_index(self, loop: int) -> int:
        """Row of ``EncodedGroup.alpha`` holding a non-anchor loop's alpha."""
        if loop == self.anchor:
            raise ValueError(f"loop {loop} is the anchor and has no alpha")
        return loop if loop < self.anchor else loop - 1

    def encode_order(self) -> tuple[int, ...]:
        """Loops in an order where every reference is reconstructed before it is used."""
        rest = [r for r in range(self.num_loops) if r != self.anchor]
        if self.reference == "next":
            rest = rest[::-1]
        return (self.anchor, *rest)


class EncodedGroup(NamedTuple):
    """A coded loop group (pytree).

    loops: tuple of ``L`` ``affine.Quantized`` (codes ``[..., D]``, metadata ``[..., D // g_r]``).
    alpha: ``[L-1, ...]`` in ``alpha_dtype`` for the non-anchor loops in loop order
           (see ``ResidualConfig.alpha_index``), or ``None`` when least squares is off.
    out_of_range: ``[...]`` int32 from the encoder: per vector, the loops' metadata values the
           metadata dtype could not hold plus non-finite targets (``affine.out_of_range``); not stored.
    """

    loops: tuple
    alpha: jax.Array | None
    out_of_range: jax.Array | None = None


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis ``[..., D] -> [...]`` in one fixed order: padded with zeros to a power of two,
    then halves added elementwise (x[:h] + x[h:]) until one value is left. Float addition is not
    associative, so a sum whose bits must be reproducible (the native encoder's, `cpu_kernels`) takes
    this order rather than whatever a compiler's reduction picks."""
    d = x.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def ls_alpha(x: jax.Array, ref: jax.Array, alpha_dtype=jnp.bfloat16) -> jax.Array:
    """Least-squares scale ``<x, ref> / |ref|^2`` per vector: ``[..., D], [..., D] -> [...]``.

    Computed in float32 and rounded to ``alpha_dtype`` (saturating at its finite max). When
    ``|ref|^2`` underflows (below float32 ``tiny``) the result is 0, i.e. the residual is ``x``. Every
    product is rounded before it is summed and the sums are `pairwise_sum`s: the same bits whatever the
    compiler fuses (the native encoder computes exactly this).
    """
    x = jnp.asarray(x, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    num = pairwise_sum(affine.unfused(x * ref))
    den = pairwise_sum(affine.unfused(ref * ref))
    ok = den > jnp.finfo(jnp.float32).tiny
    a = jnp.where(ok, num / affine.exact_divisor(jnp.where(ok, den, 1.0)), 0.0)
    m = float(jnp.finfo(alpha_dtype).max)
    return jnp.clip(jnp.nan_to_num(a), -m, m).astype(alpha_dtype)


def _mean_rows(mean, shape):
    if mean is None:
        return [None] * shape[0]
    mean = jnp.broadcast_to(jnp.asarray(mean, jnp.float32), shape)
    return [mean[r] for r in range(shape[0])]


def _add(a, b):
    return a if b is None else a + b


def _sub(a, b):
    return a if b is None else a - b


def encode_decode_group(
    z: jax.Array, cfg: ResidualConfig, mean: jax.Array | None = None
) -> tuple[EncodedGroup, jax.Array]:
    """Encode ``z [L, ..., D]`` and also return the encoder's reconstruction ``[L, ..., D]`` f32.

    The reconstruction is what ``decode_group`` returns for the code (see the module note on FMA).
    """
    z = jnp.asarray(z, jnp.float32)
    n = cfg.num_loops
    if z.shape[0] != n:
        raise ValueError(f"z has {z.shape[0]} loops on axis 0, config has {n}")
    mu = _mean_rows(mean, z.shape)
    codes: list = [None] * n
    alphas: list = [None] * n
    recon: list = [None] * n
    oor = None
    for r in cfg.encode_order():
        qc = cfg.quant_config(r)
        if r == cfg.anchor:
            pred = None
        else:
            ref = recon[cfg.parent(r)]
            if cfg.least_squares:
                alphas[r] = ls_alpha(z[r], ref, cfg.alpha_dtype)
                pred = affine.unfused(alphas[r].astype(jnp.float32)[..., None] * ref)  # rounded: no FMA with z
            else:
                pred = ref
        target = _sub(_sub(z[r], pred), mu[r])
        codes[r] = affine.quantize(target, qc)
        lost = affine.out_of_range(target, qc)
        oor = lost if oor is None else oor + lost
        recon[r] = _add(_add(affine.dequantize(codes[r], qc), pred), mu[r])
    alpha = None
    if cfg.least_squares:
        rows = [alphas[r] for r in range(n) if r != cfg.anchor]
        alpha = jnp.stack(rows) if rows else jnp.zeros((0,) + z.shape[1:-1], cfg.alpha_dtype)
    return EncodedGroup(tuple(codes), alpha, oor), jnp.stack(recon)


def encode_group(z: jax.Array, cfg: ResidualConfig, mean: jax.Array | None = None) -> EncodedGroup:
    """Encode a loop group ``z [L, ..., D]`` (rotated space); ``mean`` broadcastable to ``z`` or None."""
    return encode_decode_group(z, cfg, mean)[0]


def _decode(enc: EncodedGroup, cfg: ResidualConfig, loop: int, mean_rows, memo: dict) -> jax.Array:
    if loop in memo:
        return memo[loop]
    x = affine.dequantize(enc.loops[loop], cfg.quant_config(loop))
    if loop != cfg.anchor:
        ref = _decode(enc, cfg, cfg.parent(loop), mean_rows, memo)
        if cfg.least_squares:
            ref = enc.alpha[cfg.alpha_index(loop)].astype(jnp.float32)[..., None] * ref
        x = x + ref
    x = _add(x, mean_rows[loop])
    memo[loop] = x
    return x


def _group_shape(enc: EncodedGroup) -> tuple[int, ...]:
    return (len(enc.loops),) + enc.loops[0].codes.shape


def decode_group(enc: EncodedGroup, cfg: ResidualConfig, mean: jax.Array | None = None) -> jax.Array:
    """Reconstruct all loops ``[L, ..., D]`` float32 (rotated space) from ``encode_group``'s output."""
    mu = _mean_rows(mean, _group_shape(enc))
    memo: dict = {}
    return jnp.stack([_decode(enc, cfg, r, mu, memo) for r in range(cfg.num_loops)])


def decode_loop(
    enc: EncodedGroup, cfg: ResidualConfig, loop: int, mean: jax.Array | None = None
) -> jax.Array:
    """Reconstruct one loop ``[..., D]`` float32. "last"/"first" read only the anchor and this loop;
    chained policies rebuild the chain from the anchor. ``loop`` is a static Python int.
    """
    if not 0 <= loop < cfg.num_loops:
        raise ValueError(f"loop {loop} out of range for a group of {cfg.num_loops}")
    return _decode(enc, cfg, loop, _mean_rows(mean, _group_shape(enc)), {})
