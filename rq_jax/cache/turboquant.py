"""The `turboquant` format: vLLM's shipped low-bit KV caches (`--kv-cache-dtype turboquant_*`), as vLLM
0.34.0 stores them (`vllm/model_executor/layers/quantization/turboquant/{config,centroids}.py`,
`vllm/v1/attention/ops/triton_turboquant_{store,decode}.py`), every loop of a looped model stored on
its own.

Per token and kv head, over the whole head dim D (no channel groups):

* keys, `preset` "k8v4": cast to FP8 E4M3 as they are (no scale, no rotation). The others ("4bit_nc",
  "k3v4_nc", "3bit_nc"): the norm n = ‖k‖ (float32, stored in float16), the unit vector k / (n + 1e-8)
  rotated by the orthonormal Sylvester Hadamard H (H = Hᵀ = H⁻¹, shared by every layer and head, no
  random signs), each coordinate bucketed against the midpoints of the Lloyd-Max centroids of
  N(0, 1/D) at 4 or 3 bits (`centroids`; a coordinate equal to a midpoint goes up). Decoded:
  c = centroids[idx], re-normalised to unit length ("nc", norm correction), k̂ = (n·c) H.
* values: asymmetric min/max at 4 or 3 bits, scale = max((max − min) / (2^b − 1), 1e-8) and zero = min
  computed in float32 and stored in float16, codes ⌊(v − min) / scale + 0.5⌋ clamped, computed with the
  float32 scale and min; decoded q·scale + zero with the stored ones.
* packing: 4-bit codes two per byte (element 2i in the low nibble); 3-bit codes as a least-significant-
  bit-first stream, 8 codes per 3 bytes.

Bytes per token and kv head are vLLM's slot: key ⌈D·b_k/8⌉ (+ 2 for the norm; FP8: D) plus value
⌈D·b_v/8⌉ + 4 — at D = 128: 196, 134, 118 and 102 against bf16's 512 (2.6×, 3.8×, 4.3×, 5.0×).

What vLLM does around the store and is not the format: queries, the prompt's first prefill chunk and
(by default) the first and last min(2, layers / 2) attention layers stay in full precision. A call's
own tokens attend in full precision here too (`rq_jax.cache.base`); the boundary layers are not kept
apart (on the 2-layer models here that would keep every layer). The Hadamard rotation needs D a power
of 2, here as in vLLM. Non-finite K/V entries (which vLLM does not expect) are stored as 0 and counted.

Attention decodes one context tile at a time (`base.tiled_attend`): XLA, no kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from rq_jax.cache import base
from rq_jax.quant import affine, rotation
from rq_jax.shapes import Lengths, NumNew, SegmentKV, SlotKV

_HI = jax.lax.Precision.HIGHEST
#: vLLM's presets (`TQ_PRESETS`, without the "turboquant_" prefix): key bits (8: FP8 keys), value bits,
#: norm correction.
PRESETS = {"k8v4": (8, 4, False), "4bit_nc": (4, 4, True), "k3v4_nc": (3, 4, True), "3bit_nc": (3, 3, True)}
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


@functools.cache
def centroids(dim: int, bits: int) -> np.ndarray:
    """The 2^bits Lloyd-Max centroids of N(0, 1/dim), sorted, float32, as vLLM's `solve_lloyd_max` finds
    them: start evenly spaced over ±3.5σ, outer edges at ±10.5σ, each cell's centroid by the trapezoid rule
    on 200 intervals, in float64, until no centroid moves by 1e-10 (then the previous iterate is kept) or
    for 200 iterations (the 4-bit solve does not converge)."""
    levels, sigma2 = 2**bits, 1.0 / dim
    sigma = math.sqrt(sigma2)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = np.array([lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)])

    def trapz(f, a, b, n=200):  # [cells] → [cells], each cell's ∫ f over [a, b]
        h = (b - a) / n
        x = a[:, None] + h[:, None] * np.arange(n + 1)[None, :]
        y = f(x)
        return (0.5 * (y[:, 0] + y[:, -1]) + y[:, 1:-1].sum(axis=1)) * h

    def pdf(x):
        return (1.0 / math.sqrt(2 * math.pi * sigma2)) * np.exp(-x * x / (2 * sigma2))

    for _ in range(200):
        edges = np.concatenate([[lo * 3], (c[:-1] + c[1:]) / 2.0, [hi * 3]])
        num = trapz(lambda x: x * pdf(x), edges[:-1], edges[1:])
        den = trapz(pdf, edges[:-1], edges[1:])
        new = np.where(den > 1e-15, num / np.where(den > 1e-15, den, 1.0), c)
        if np.max(np.abs(new - c)) < 1e-10:
            break
        c = new
    return c.astype(np.float32)


def midpoints(dim: int, bits: int) -> np.ndarray:
    """The bucket boundaries: midpoints of consecutive centroids, in float32 (vLLM's `_tq_midpoints`)."""
    c = centroids(dim, bits)
    return (c[:-1] + c[1:]) / 2


def pack(codes: UInt8[Array, "... d"], bits: int) -> UInt8[Array, "... p"]:
    """vLLM's packing of codes < 2^bits along the last axis: 4 bits two per byte (element 2i low), 3 bits
    a least-significant-bit-first stream (8 codes per 3 bytes)."""
    codes = codes.astype(jnp.uint32)
    if bits == 4:
        pairs = codes.reshape(*codes.shape[:-1], -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    if bits == 3:
        octets = codes.reshape(*codes.shape[:-1], -1, 8)
        word = jnp.sum(octets << (3 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
        return jnp.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=-1).reshape(*codes.shape[:-1], -1).astype(
            jnp.uint8)
    raise ValueError(f"turboquant packs 3 or 4 bits, not {bits}")


def unpack(packed: UInt8[Array, "... p"], bits: int, dim: int) -> UInt8[Array, "... d"]:
    """The inverse of `pack`: codes [..., dim]."""
    packed = packed.astype(jnp.uint32)
    if bits == 4:
        return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], dim).astype(jnp.uint8)
    octets = packed.reshape(*packed.shape[:-1], -1, 3)
    word = octets[..., 0] | (octets[..., 1] << 8) | (octets[..., 2] << 16)
    codes = (word[..., None] >> (3 * jnp.arange(8, dtype=jnp.uint32))) & 7
    return codes.reshape(*packed.shape[:-1], dim).astype(jnp.uint8)


class TurboSlot(NamedTuple):
    """One loop's stored K/V, leaves [G, N, B, K, S, ...]: key codes (uint8 packed indices [.., ⌈D·b/8⌉],
    or FP8 values [.., D]), key norms (float16 [..]; None for FP8 keys), value codes (uint8 [.., ⌈D·b/8⌉]),
    value scales and zeros (float16 [..])."""

    k_codes: Array
    k_norm: Array | None
    v_codes: Array
    v_scale: Array
    v_zero: Array


@base.register("turboquant")
@dataclasses.dataclass(frozen=True)
class TurboQuant(base.CacheFormat):
    """vLLM's TurboQuant KV cache at `preset` ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc"); see the module
    docstring. Every loop is its own group."""

    preset: str = "4bit_nc"
    name: str = dataclasses.field(default="turboquant", init=False)
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"turboquant: unknown preset {self.preset!r}: expected one of {sorted(PRESETS)}")

    @property
    def key_bits(self) -> int:
        """8 for FP8 keys, else the Lloyd-Max index width."""
        return PRESETS[self.preset][0]

    @property
    def value_bits(self) -> int:
        return PRESETS[self.preset][1]

    @property
    def norm_correction(self) -> bool:
        return PRESETS[self.preset][2]

    # ---- the quantizer (one vector per token and head, the last axis) ----------------------------

    def encode_keys(self, k: Float[Array, "... d"]) -> tuple[Array, Array | None]:
        """Key codes and norms of K [..., D] (float32 arithmetic): FP8 values and None, or packed
        Lloyd-Max indices of the rotated unit vectors and their float16 norms."""
        k = k.astype(jnp.float32)
        if self.key_bits == 8:
            return jnp.clip(k, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), None
        d = k.shape[-1]
        norm = jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True))
        unit = k / affine.exact_divisor(norm + 1e-8, k.shape)  # divided as written (see `affine`)
        y = jnp.einsum("...d,de->...e", unit, rotation.hadamard(d), precision=_HI)
        idx = jnp.sum(y[..., None] >= jnp.asarray(midpoints(d, self.key_bits)), axis=-1)
        idx = jnp.minimum(idx, 2**self.key_bits - 1).astype(jnp.uint8)
        return pack(idx, self.key_bits), norm[..., 0].astype(jnp.float16)

    def rotated_keys(self, codes: Array, norm: Array | None, dim: int) -> Float[Array, "... d"]:
        """The decoded keys in the rotated basis, n·c (float32, vLLM's `_tq_full_dequant_kv` before its fp16
        store); FP8 keys as they are."""
        if norm is None:
            return codes.astype(jnp.float32)
        c = jnp.asarray(centroids(dim, self.key_bits))[unpack(codes, self.key_bits, dim).astype(jnp.int32)]
        if self.norm_correction:
            c = c * (1.0 / jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True) + 1e-16))
        return norm.astype(jnp.float32)[..., None] * c

    def decode_keys(self, codes: Array, norm: Array | None, dim: int) -> Float[Array, "... d"]:
        """Keys [..., D] float32: the rotated ones taken back by H (its own inverse)."""
        k = self.rotated_keys(codes, norm, dim)
        return k if norm is None else jnp.einsum("...e,ed->...d", k, rotation.hadamard(dim), precision=_HI)

    def encode_values(self, v: Float[Array, "... d"]) -> tuple[Array, Array, Array]:
        """Packed value codes, float16 scales and zeros of V [..., D]."""
        v = v.astype(jnp.float32)
        top = 2**self.value_bits - 1
        lo, hi = jnp.min(v, axis=-1, keepdims=True), jnp.max(v, axis=-1, keepdims=True)
        scale = (hi - lo) / affine.exact_divisor(top, lo.shape)
        scale = jnp.where(scale > 1e-8, scale, 1e-8)
        q = jnp.clip(jnp.floor((v - lo) / affine.exact_divisor(scale, v.shape) + 0.5), 0, top).astype(jnp.uint8)
        return pack(q, self.value_bits), scale[..., 0].astype(jnp.float16), lo[..., 0].astype(jnp.float16)

    def decode_values(self, codes: Array, scale: Array, zero: Array, dim: int) -> Float[Array, "... d"]:
        """Values [..., D] float32: code · scale + zero, with the stored float16 scale and zero."""
        q = unpack(codes, self.value_bits, dim).astype(jnp.float32)
        return q * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]

    # ---- the CacheFormat protocol -------------------------------------------------------------------

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[TurboSlot]:
        """Zeroed codes, norms, scales and zeros (the packed widths of vLLM's slot)."""
        if head_dim & (head_dim - 1) or head_dim % 8:
            raise ValueError(f"turboquant: head_dim {head_dim} must be a power of 2 and a multiple of 8")
        lead = (seg.groups, num_layers, batch, num_kv_heads, max_len)
        fp8 = self.key_bits == 8
        key = jnp.zeros(lead + (head_dim,), jnp.float8_e4m3fn) if fp8 else \
            jnp.zeros(lead + (head_dim * self.key_bits // 8,), jnp.uint8)
        return (TurboSlot(key, None if fp8 else jnp.zeros(lead, jnp.float16),
                          jnp.zeros(lead + (head_dim * self.value_bits // 8,), jnp.uint8),
                          jnp.zeros(lead, jnp.float16), jnp.zeros(lead, jnp.float16)),)

    def write(self, state, k: SegmentKV, v: SegmentKV, lengths: Lengths, num_new: NumNew, calib,
              table: base.Table | None = None) -> base.Written:
        """Encode new K/V [G, 1, N, B, K, T, D] and store them at lengths[b] + t, t < num_new[b]. Per row,
        the new tokens' non-finite entries (stored as 0) and keys outside FP8's range (k8v4: clamped to
        ±448) are the out-of-range count."""
        k, v = k[:, 0].astype(jnp.float32), v[:, 0].astype(jnp.float32)
        lost = jnp.sum(~jnp.isfinite(k), axis=-1) + jnp.sum(~jnp.isfinite(v), axis=-1)
        if self.key_bits == 8:
            lost = lost + jnp.sum(jnp.abs(k) > FP8_MAX, axis=-1)
        k, v = (jnp.where(jnp.isfinite(x), x, 0.0) for x in (k, v))
        new = TurboSlot(*self.encode_keys(k), *self.encode_values(v))
        fresh = jnp.arange(k.shape[4])[None, :] < num_new[:, None]  # [B, T]
        lost = jnp.sum(jnp.where(fresh[:, None], lost, 0), axis=(0, 1, 3, 4))
        return base.Written((base.scatter_tokens(state[0], new, lengths, num_new, table),), lost.astype(lengths.dtype))

    def reconstruct(self, state, index, loop, lengths: Lengths, calib) -> tuple[SlotKV, SlotKV]:
        """The stored K, V of slot `index` decoded to float32 [B, K, S, D] (0 past each row's length)."""
        slot = base.at(state[loop], index)
        d = slot.v_codes.shape[-1] * 8 // self.value_bits
        k = self.decode_keys(slot.k_codes, slot.k_norm, d)
        v = self.decode_values(slot.v_codes, slot.v_scale, slot.v_zero, d)
        valid = base.valid_tokens(lengths, k.shape[2])[:, None, :, None]
        return jnp.where(valid, k, 0.0), jnp.where(valid, v, 0.0)

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """vLLM's slot bits per element, averaged over K and V: keys 8 (FP8) or b_k + 16/D (the norm),
        values b_v + 32/D (scale and zero)."""
        key = Fraction(8) if self.key_bits == 8 else Fraction(self.key_bits) + Fraction(16, head_dim)
        return (key + self.value_bits + Fraction(32, head_dim)) / 2

    def describe(self) -> str:
        """E.g. "vLLM turboquant_4bit_nc: Hadamard + Lloyd-Max INT4 keys, INT4 values"."""
        keys = "FP8 keys" if self.key_bits == 8 else f"Hadamard + Lloyd-Max INT{self.key_bits} keys"
        return f"vLLM turboquant_{self.preset}: {keys}, INT{self.value_bits} values"
