"""Bit packing of unpacked uint8 codes along the channel axis (planar layout).

For ``bits`` in {1, 2, 4, 8} a byte holds ``P = 8 // bits`` codes. With ``D`` channels and
``J = D // P`` bytes, byte ``j`` holds channels ``j, j + J, j + 2J, ..., j + (P-1)J``; channel
``j + kJ`` sits in bits ``[k*bits, (k+1)*bits)`` (least significant first)::

    packed[..., j] = sum_k codes[..., j + k*J] << (k*bits)
    codes[..., k*J : (k+1)*J] = (packed >> (k*bits)) & (2**bits - 1)

Unpacking is therefore ``P`` shift-and-mask ops on the whole packed row, each producing a contiguous
slice of channels: no interleave/transpose, which is what a fused attention kernel wants (it can also
split the query into the same ``P`` contiguous slices and never reassemble the keys).

3 bits are stored as two planes: the low two bits of every channel packed as the 2-bit layout above
(``D // 4`` bytes), followed by the high bit packed as the 1-bit layout (``D // 8`` bytes)::

    packed = concat(pack(codes & 3, 2), pack(codes >> 2, 1))        # [..., 3D/8]
    codes  = unpack(packed[..., :D/4], 2) | (unpack(packed[..., D/4:], 1) << 2)

16-bit "codes" (bfloat16 values, the identity setting of ``affine``) are stored as they are; 0-bit codes
(``affine``'s nothing-stored setting) take no bytes: ``[..., 0]``.

No padding anywhere: ``D`` must be divisible by ``P`` (by 8 for 3 bits), else ValueError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from rq_jax.quant import affine

_PER_BYTE = {1: 8, 2: 4, 4: 2, 8: 1}


def packed_dim(dim: int, bits: int) -> int:
    """Elements per packed row of ``dim`` ``bits``-bit codes (``dim * bits // 8`` bytes; ``dim`` bfloat16
    values at 16 bits); validates ``dim``."""
    if bits == 16:
        return dim
    if bits == 0:
        return 0
    if bits == 3:
        if dim % 8:
            raise ValueError(f"3-bit packing needs dim divisible by 8, got dim={dim}")
        return dim * 3 // 8
    if bits not in _PER_BYTE:
        raise ValueError(f"invalid bit width {bits!r}: expected one of (0, 1, 2, 3, 4, 8, 16)")
    p = _PER_BYTE[bits]
    if dim % p:
        raise ValueError(f"{bits}-bit packing needs dim divisible by {p}, got dim={dim}")
    return dim // p


def unpacked_dim(packed: int, bits: int) -> int:
    """Inverse of ``packed_dim``: channels in a packed row of ``packed`` elements."""
    if bits == 0:
        raise ValueError("0-bit codes take no bytes: their channel count is not in the packed row")
    return packed if bits == 16 else packed * 8 // bits


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack uint8 codes ``[..., D]`` (values < 2**bits) into uint8 ``[..., packed_dim(D, bits)]``."""
    d = codes.shape[-1]
    packed_dim(d, bits)
    if bits == 16:
        return codes
    if bits == 0:
        return jnp.zeros(codes.shape[:-1] + (0,), jnp.uint8)
    codes = codes.astype(jnp.uint8)
    if bits == 3:
        return jnp.concatenate([pack(codes & 3, 2), pack(codes >> 2, 1)], axis=-1)
    if bits == 8:
        return codes
    p = _PER_BYTE[bits]
    j = d // p
    mask = (1 << bits) - 1
    out = jnp.zeros(codes.shape[:-1] + (j,), jnp.uint8)
    for k in range(p):
        out = out | ((codes[..., k * j : (k + 1) * j] & mask) << (k * bits))
    return out


def unpack(packed: jax.Array, bits: int, dim: int) -> jax.Array:
    """Inverse of ``pack``: uint8 ``[..., packed_dim(dim, bits)]`` -> uint8 codes ``[..., dim]``."""
    n = packed_dim(dim, bits)
    if packed.shape[-1] != n:
        raise ValueError(f"packed last dim {packed.shape[-1]} != packed_dim({dim}, {bits}) = {n}")
    if bits == 16:
        return packed
    if bits == 0:
        return jnp.zeros(packed.shape[:-1] + (dim,), jnp.uint8)
    packed = packed.astype(jnp.uint8)
    if bits == 3:
        lo = unpack(packed[..., : dim // 4], 2, dim)
        hi = unpack(packed[..., dim // 4 :], 1, dim)
        return lo | (hi << 2)
    if bits == 8:
        return packed
    mask = jnp.uint8((1 << bits) - 1)
    return jnp.concatenate(
        [(packed >> (k * bits)) & mask for k in range(_PER_BYTE[bits])], axis=-1
    )


@struct.dataclass
class PackedCodes:
    """Affine-quantized vectors as stored: packed codes with their metadata, carrying their own width.

    codes:  uint8 ``[..., packed_dim(dim, bits)]`` (bfloat16 ``[..., dim]`` at 16 bits).
    scale, offset: ``[..., dim // group_size]`` in the metadata dtype (``[..., 0]`` at 16 bits).
    super_scale: bfloat16 ``[..., 1]`` when the metadata is relative to a per-vector super-scale, else None.
    ``bits``, ``dim`` and ``group_size`` are static (part of the pytree structure, not leaves).
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array
    bits: int = struct.field(pytree_node=False)
    dim: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    super_scale: jax.Array | None = None

    @classmethod
    def from_quantized(cls, q: affine.Quantized, cfg: affine.QuantConfig) -> "PackedCodes":
        """Pack ``affine.quantize``'s output ``[..., D]`` (the metadata is kept as it is)."""
        return cls(pack(q.codes, cfg.bits), q.scale, q.offset, cfg.bits, q.codes.shape[-1], cfg.group_size,
                   q.super_scale)

    def unpacked(self) -> affine.Quantized:
        """The unpacked codes ``[..., dim]`` with their metadata."""
        return affine.Quantized(unpack(self.codes, self.bits, self.dim), self.scale, self.offset, self.super_scale)

    def dequantize(self) -> jax.Array:
        """The stored vectors ``[..., dim]`` in float32 (``offset + scale * code`` per group)."""
        cfg = affine.QuantConfig(self.bits, self.group_size, meta_dtype=self.scale.dtype,
                                 super_scale=self.super_scale is not None)
        return affine.dequantize(self.unpacked(), cfg)

    def effective(self) -> "PackedCodes":
        """The same codes with the super-scale folded into float32 scale and offset ``[..., dim // g]``
        (exact), so readers of plain metadata (the attention paths, the kernel) need not know it."""
        if self.super_scale is None:
            return self
        sup = self.super_scale.astype(jnp.float32)
        return PackedCodes(self.codes, self.scale.astype(jnp.float32) * sup, self.offset.astype(jnp.float32) * sup,
                           self.bits, self.dim, self.group_size)

    def map(self, fn) -> "PackedCodes":
        """The same codes with ``fn`` applied to every array (e.g. indexing a slot out of a stack)."""
        return jax.tree_util.tree_map(fn, self)
