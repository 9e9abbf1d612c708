"""The `kivi` format: KIVI's cache, bookkept as KIVI's code keeps it (jy-yuan/KIVI, `models/llama_kivi.py`).

KIVI quantizes keys **per channel** over groups of G = `key_group` consecutive tokens (from token 0)
and values **per token** over groups of `value_group` consecutive channels, with the asymmetric min/max
quantizer (zero-point = group minimum, scale = (max − min)/(2^b − 1), codes clamped; `rq_jax.quant.affine`
at clip 1) and keeps a **residual** of R = `residual_length` recent tokens in full precision. For a row
holding L tokens:

* keys: the first ⌊L/R⌋·R are quantized, the last L mod R (< R) are kept in full precision. Keys wait in
  the full-precision buffer and are quantized R at a time, the moment it fills (in G-groups; R is a
  multiple of G), so a prefill of L tokens quantizes its first ⌊L/R⌋·R keys at once.
* values: the last min(L, R) are kept in full precision (a sliding window); each older one is
  quantized when it leaves the window.

That is KIVI's prefill (one call of L tokens) and decode (one token per call) bookkeeping, and it depends
on L alone, so any split of the writes — a second prompt turn, ragged rows — gives the same state.
KIVI never quantizes at R = 0 (its code divides by R), so R ≥ 1 here.

Defaults are KIVI's published configuration, KIVI-2 as its paper evaluates it: 2 bits for K and V,
G = 32 for both, R = 128 (the repository's example uses R = 32), and everything KIVI keeps in the model
dtype — scales, minima and the full-precision tokens — in float16, its runs' dtype; codes round half to
even (`torch.round`). `rounding="half_down"`, FP8 metadata or a bf16 residual make it a ResidualQuant-style
variant instead. Unlike the paper's "Direct" baseline (`uniform`: every loop INTn per token in channel
groups, FP8 metadata, nothing kept in full precision), KIVI quantizes keys per channel across tokens and
keeps the last R tokens' values and the last L mod R keys exact.

State layout (`KiviState`, every loop its own group, so one slot per group position with leading
axes [G, N] = [loops, layers]; S = max_len, Sq = ⌊S/R⌋·R keys that can ever be quantized, J = Sq/G,
Sv = max(S − R, 0) values that can, Wk = min(R − 1, S) and Wv = min(R, S) full-precision slots,
P = packed bytes per row = D·bits/8)::

    k_codes  uint8 [G, N, B, K, Sq, P]      channel-packed key codes
    k_scale  meta  [G, N, B, K, J, D]       per (token group, channel)
    k_offset meta  [G, N, B, K, J, D]
    k_full   res   [G, N, B, K, Wk, D]      the last L mod R keys: position s at slot s mod R
    v_codes  uint8 [G, N, B, K, Sv, P]
    v_scale  meta  [G, N, B, K, Sv, D // gv] per (token, channel group)
    v_offset meta  [G, N, B, K, Sv, D // gv]
    v_full   res   [G, N, B, K, Wv, D]      the last min(L, R) values: position s at slot s mod R

Accounting: `bits_per_element(loops, D, context_len=L)` is what KIVI holds at L tokens — codes and
metadata of the quantized tokens plus the full-precision ones at `residual_dtype` bits, averaged over
K and V; without `context_len` it is the long-context limit (codes and metadata only). `cache_nbytes`
counts the arrays, i.e. the capacity above (the full-precision buffers at their full size).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from rq_jax.cache import base
from rq_jax.quant import affine, packing
from rq_jax.quant import bits as qbits
from rq_jax.shapes import Lengths, NumNew, Queries, SlotKV, Visible

_RESIDUAL_DTYPES = ("bfloat16", "float16", "float32")


def _rows(state: "KiviState", table: base.Table | None) -> "KiviState":
    """The rows of a paged cache's pool through `table` [B, 1] (`base.rows_of_pages`; None: contiguous, the
    state as it is). kivi's windows of full-precision tokens are per row, so its pages are whole rows."""
    if table is None:
        return state
    if table.shape[1] != 1:
        raise ValueError(f"the kivi cache keeps per-row windows of full-precision tokens: its pages are whole rows "
                         f"(one page per row), got {table.shape[1]} pages a row")
    return jax.tree_util.tree_map(lambda x: base.rows_of_pages(x, table), state)


class KiviState(NamedTuple):
    """Quantized and full-precision K/V of every (loop, layer) slot; layout in the module docstring."""

    k_codes: UInt8[Array, "l n b k sq p"]
    k_scale: Array
    k_offset: Array
    k_full: Array
    v_codes: UInt8[Array, "l n b k sv p"]
    v_scale: Array
    v_offset: Array
    v_full: Array


def _take_tokens(x: Array, index: Int[Array, "b m"]) -> Array:
    """Per-row token gather: x [G, N, B, K, T, D], index [B, M] -> [G, N, B, K, M, D] (x[..., b, :, index[b], :])."""
    l, n, b, k, _, d = x.shape
    idx = jnp.broadcast_to(index[None, None, :, None, :, None], (l, n, b, k, index.shape[1], d))
    return jnp.take_along_axis(x, idx, axis=4)


def _ring_positions(lengths: Lengths, slots: int, period: int) -> Int[Array, "b w"]:
    """Position held by ring slot i of a row of `lengths[b]` tokens: the newest p < length with
    p ≡ i (mod period); negative when there is none."""
    last = lengths[:, None] - 1
    return last - (last - jnp.arange(slots)[None, :]) % period


@base.register("kivi")
@dataclasses.dataclass(frozen=True)
class Kivi(base.CacheFormat):
    """KIVI policy. `bits` ∈ {1, 2, 3, 4, 8} for keys and values (or a one-element sequence of it);
    `key_group` G tokens per key group
    (per channel); `value_group` channels per value group (per token, must divide head_dim);
    `residual_length` R ≥ 1 recent tokens kept in full precision (a multiple of G); `meta_dtype` of
    scales/offsets ("float16", "bfloat16", "float32", "float8_e4m3fn"); `residual_dtype` of the
    full-precision tokens ("float16", "bfloat16", "float32"); `rounding` "half_even" (KIVI's) or
    "half_down" (the ResidualQuant spec's); `clip` range factor in (0, 1] (1 = KIVI's plain min/max).
    `group_size`, if given, sets both groups, as KIVI's single `group_size` does (it is then folded into
    them and reads None)."""

    bits: int = 2
    key_group: int = 32
    value_group: int = 32
    residual_length: int = 128
    meta_dtype: str = "float16"
    residual_dtype: str = "float16"
    rounding: str = "half_even"
    clip: float = 1.0
    group_size: int | None = None
    name: str = dataclasses.field(default="kivi", init=False)
    pageable: ClassVar[bool] = False
    full_precision_part: ClassVar[str] = "kivi's window of recent tokens, residual_length"
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        def positive_int(field, value, minimum=1):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"kivi {field} must be an integer >= {minimum}, got {value!r}")

        if np.ndim(self.bits) == 1 and len(self.bits) == 1:  # one width for every loop, as the others take it
            object.__setattr__(self, "bits", self.bits[0])
        if self.group_size is not None:
            positive_int("group_size", self.group_size)
            for field in ("key_group", "value_group", "group_size"):
                object.__setattr__(self, field, None if field == "group_size" else self.group_size)
        quantized_bits = tuple(b for b in affine.VALID_BITS if b not in (affine.PASSTHROUGH_BITS, affine.DROP_BITS))
        if self.bits not in quantized_bits:
            raise ValueError(f"kivi bits must be one of {quantized_bits}, got {self.bits!r}")
        positive_int("key_group", self.key_group)
        positive_int("value_group", self.value_group)
        positive_int("residual_length", self.residual_length)
        if self.residual_length % self.key_group:
            raise ValueError(f"kivi residual_length {self.residual_length} must be a multiple of key_group "
                             f"{self.key_group} (keys are quantized R at a time, in groups of G)")
        try:
            meta = np.dtype(self.meta_dtype)
        except TypeError:
            meta = None
        if meta not in affine.META_DTYPES:
            raise ValueError(f"kivi meta_dtype must be one of {[d.name for d in affine.META_DTYPES]}, "
                             f"got {self.meta_dtype!r}")
        object.__setattr__(self, "meta_dtype", meta.name)
        if self.residual_dtype not in _RESIDUAL_DTYPES:
            raise ValueError(f"kivi residual_dtype must be one of {_RESIDUAL_DTYPES}, got {self.residual_dtype!r}")
        if self.rounding not in affine.ROUNDINGS:
            raise ValueError(f"kivi rounding must be one of {affine.ROUNDINGS}, got {self.rounding!r}")
        if not isinstance(self.clip, (int, float)) or not 0.0 < float(self.clip) <= 1.0:
            raise ValueError(f"kivi clip must lie in (0, 1], got {self.clip!r}")

    @property
    def key_config(self) -> affine.QuantConfig:
        """The key quantizer: groups of `key_group` tokens of one channel."""
        return affine.QuantConfig(self.bits, self.key_group, meta_dtype=self.meta_dtype, clip=self.clip,
                                  rounding=self.rounding)

    @property
    def value_config(self) -> affine.QuantConfig:
        """The value quantizer: groups of `value_group` channels of one token."""
        return affine.QuantConfig(self.bits, self.value_group, meta_dtype=self.meta_dtype, clip=self.clip,
                                  rounding=self.rounding)

    def sizes(self, max_len: int) -> tuple[int, int, int, int]:
        """(Sq, Sv, Wk, Wv) for a cache of `max_len`: quantizable keys and values, full-precision slots."""
        r = self.residual_length
        return max_len // r * r, max(max_len - r, 0), min(r - 1, max_len), min(r, max_len)

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[KiviState]:
        """An empty segment state, [G, N] slots of [B, K, ...] (layout in the module docstring).

        Raises ValueError if head_dim is not divisible by `value_group` or cannot be packed at `bits`.
        """
        if head_dim % self.value_group:
            raise ValueError(f"kivi value_group {self.value_group} must divide head_dim {head_dim}")
        try:
            p = packing.packed_dim(head_dim, self.bits)
        except ValueError as e:
            raise ValueError(f"kivi bits={self.bits} cannot pack head_dim {head_dim}: {e}") from None
        lead = (seg.groups, num_layers, batch, num_kv_heads)
        sq, sv, wk, wv = self.sizes(max_len)
        meta, res = jnp.dtype(self.meta_dtype), jnp.dtype(self.residual_dtype)
        return (KiviState(
            k_codes=jnp.zeros((*lead, sq, p), jnp.uint8),
            k_scale=jnp.zeros((*lead, sq // self.key_group, head_dim), meta),
            k_offset=jnp.zeros((*lead, sq // self.key_group, head_dim), meta),
            k_full=jnp.zeros((*lead, wk, head_dim), res),
            v_codes=jnp.zeros((*lead, sv, p), jnp.uint8),
            v_scale=jnp.zeros((*lead, sv, head_dim // self.value_group), meta),
            v_offset=jnp.zeros((*lead, sv, head_dim // self.value_group), meta),
            v_full=jnp.zeros((*lead, wv, head_dim), res)),)

    def write(self, state: tuple[KiviState], k: Float[Array, "g 1 n b k t d"], v: Float[Array, "g 1 n b k t d"],
              lengths: Lengths, num_new: NumNew, calib, table: base.Table | None = None) -> base.Written:
        """Store new K/V [G, 1, N, B, K, T, D], tokens t < num_new[b] at positions lengths[b] + t (of a paged
        cache: in row b's one page, `table` [B, 1]).

        Keys join the row's full-precision buffer; every R-block this fills — up to ⌈T / R⌉ of them — is
        quantized and the rest stays. Values join the window; those it pushes out (the oldest, or new
        tokens at once when T > R) are quantized. Everything passes through `residual_dtype` first, so
        the codes do not depend on how the tokens were split into calls. Tokens past max_len are
        dropped. Fixed shapes, no per-row or per-token Python loop.
        """
        new = _write(self, _rows(state[0], table), k[:, 0], v[:, 0], lengths, num_new)
        if table is not None:  # back into the pool; a row that stores nothing (padding) writes nothing back
            dest = jnp.where(num_new > 0, table[:, 0], state[0].k_full.shape[2])
            new = jax.tree_util.tree_map(lambda pool, x: pool.at[:, :, dest].set(x, mode="drop"), state[0], new)
        return base.Written((new,), base.nothing_lost(lengths))

    def _write(self, st: KiviState, k, v, lengths, num_new) -> KiviState:
        """`write`'s body, compiled by `_write` below with the policy static."""
        l, n, b, kh, t, d = k.shape
        r, gk, res = self.residual_length, self.key_group, jnp.dtype(self.residual_dtype)
        sq, sv, wk, wv = st.k_codes.shape[4], st.v_codes.shape[4], st.k_full.shape[4], st.v_full.shape[4]
        num_new = jnp.clip(num_new, 0, jnp.maximum(sv + wv - lengths, 0))  # never write past the cache (S = Sv + Wv)
        end = lengths + num_new
        k, v = k.astype(res), v.astype(res)

        # Keys. Staging: the open R-block (its first `fill` tokens are real) followed by the new tokens.
        fill = lengths % r
        blocks = -(-t // r)  # most blocks one call can complete: ⌈T / R⌉
        staging = jnp.zeros((l, n, b, kh, (blocks + 1) * r, d), res).at[:, :, :, :, :wk].set(st.k_full)
        staging = base.scatter_tokens(staging, k, fill, num_new)
        done = (fill + num_new) // r  # blocks completed by this call
        k_codes, k_scale, k_offset = st.k_codes, st.k_scale, st.k_offset
        if sq:
            groups = blocks * r // gk
            kq = affine.quantize(staging[:, :, :, :, : blocks * r].reshape(l, n, b, kh, groups, gk, d).swapaxes(-1, -2),
                                 self.key_config)  # per channel: codes [..., groups, D, G], meta [..., groups, D, 1]
            codes = packing.pack(kq.codes.swapaxes(-1, -2).reshape(l, n, b, kh, blocks * r, d), self.bits)
            k_codes = base.scatter_tokens(k_codes, codes, lengths - fill, done * r)
            k_scale, k_offset = base.scatter_tokens((k_scale, k_offset), (kq.scale[..., 0], kq.offset[..., 0]),
                                                    (lengths - fill) // gk, done * (r // gk))
        k_full = st.k_full
        if wk:
            k_full = _take_tokens(staging, done[:, None] * r + jnp.arange(wk)[None, :])
            open_slots = jnp.arange(wk)[None, :] < (end % r)[:, None]  # zero the rest: a canonical state
            k_full = jnp.where(open_slots[None, None, :, None, :, None], k_full, 0)

        # Values. Staging: positions lengths − R … lengths − 1 (window slots; negative ones unused), then
        # the new tokens: staging index j holds position lengths − R + j.
        before = lengths[:, None] - r + jnp.arange(r)[None, :]
        old = _take_tokens(st.v_full, jnp.where(before >= 0, before % r, 0))
        staging = jnp.concatenate([old, v], axis=4)
        v_codes, v_scale, v_offset = st.v_codes, st.v_scale, st.v_offset
        if sv:
            first, stop = jnp.maximum(lengths - r, 0), jnp.maximum(end - r, 0)  # positions leaving the window
            src = jnp.minimum((first - lengths + r)[:, None] + jnp.arange(t)[None, :], r + t - 1)
            vq = affine.quantize(_take_tokens(staging, src), self.value_config)
            v_codes, v_scale, v_offset = base.scatter_tokens(
                (v_codes, v_scale, v_offset), (packing.pack(vq.codes, self.bits), vq.scale, vq.offset),
                first, stop - first)
        held = _ring_positions(end, wv, r)  # [B, Wv]
        v_full = _take_tokens(staging, jnp.maximum(held - lengths[:, None] + r, 0))
        v_full = jnp.where((held >= 0)[None, None, :, None, :, None], v_full, 0)
        return KiviState(k_codes, k_scale, k_offset, k_full, v_codes, v_scale, v_offset, v_full)

    def attend(self, state: tuple[KiviState], index: base.Index, loop: int, q: Queries,
               lengths: Lengths, calib, visible: Visible | None = None,
               table: base.Table | None = None) -> base.Partial:
        """Partial attention (float32) of q [B, T, H, D] to the stored tokens s < lengths[b] of a slot
        (those `visible` [B, S] shows), one context tile at a time (`base.tiled_partial`): each tile's
        keys and values decoded at its positions (`_decode_at`), then dense attention."""
        state = (_rows(state[0], table),)
        b, t, h, d = q.shape
        st = state[0]
        max_len = st.v_codes.shape[base.TOKEN_AXIS] + st.v_full.shape[base.TOKEN_AXIS]
        tile = base.context_tile(b, t, h, st.v_full.shape[3], d, max_len)

        def part(state, start, valid):
            k, v = self._decode_at(state, index, lengths, start + jnp.arange(tile))
            return base.dense_partial(q, k, v, jnp.broadcast_to(valid[:, None, :], (b, t, tile)))

        return base.tiled_partial(part, state, (b, t, h, d), lengths, max_len, tile, visible)

    def reconstruct(self, state: tuple[KiviState], index: base.Index, loop: int, lengths: Lengths, calib
                    ) -> tuple[SlotKV, SlotKV]:
        """The stored K, V of slot (loop, layer) as float32 [B, K, S, D] (`_decode_at` every position),
        zero past each row's length."""
        st = state[0]
        max_len = st.v_codes.shape[base.TOKEN_AXIS] + st.v_full.shape[base.TOKEN_AXIS]
        valid = base.valid_tokens(lengths, max_len)[:, None, :, None]
        return tuple(jnp.where(valid, x, 0.0) for x in self._decode_at(state, index, lengths, jnp.arange(max_len)))

    def _decode_at(self, state: tuple[KiviState], index: base.Index, lengths: Lengths,
                   pos: Int[Array, "m"]) -> tuple[Float[Array, "b k m d"], Float[Array, "b k m d"]]:
        """K and V of slot `index` at positions `pos` [M] (each < S) as float32 [B, K, M, D]: dequantized
        keys at p < L − L mod R and values at p < L − R, the full-precision tokens for the rest (what a
        position ≥ L holds is unspecified). Only those positions are read (`base.slot_tokens`)."""
        st = state[0]
        r, gk, f32 = self.residual_length, self.key_group, jnp.float32
        sq, sv, wk, wv = (x.shape[base.TOKEN_AXIS] for x in (st.k_codes, st.v_codes, st.k_full, st.v_full))
        b, kh, m, d = lengths.shape[0], st.v_full.shape[3], pos.shape[0], st.v_full.shape[-1]

        def where(mask):  # [B, M] -> [B, 1, M, 1]
            return mask[:, None, :, None]

        k = jnp.zeros((b, kh, m, d), f32)
        if sq:  # per channel over groups of G tokens: position p reads its group's scale and offset
            at = jnp.minimum(pos, sq - 1)
            codes = packing.unpack(base.slot_tokens(st.k_codes, index, at), self.bits, d)
            scale, offset = base.slot_tokens((st.k_scale, st.k_offset), index, at // gk)
            per_position = dataclasses.replace(self.key_config, group_size=1)
            k = affine.dequantize(affine.Quantized(codes[..., None], scale[..., None], offset[..., None]),
                                  per_position)[..., 0]
        if wk:
            full = base.slot_tokens(st.k_full, index, jnp.minimum(pos % r, wk - 1)).astype(f32)
            k = jnp.where(where(pos[None, :] >= (lengths - lengths % r)[:, None]), full, k)
        v = jnp.zeros((b, kh, m, d), f32)
        if sv:
            codes, scale, offset = base.slot_tokens((st.v_codes, st.v_scale, st.v_offset), index,
                                                    jnp.minimum(pos, sv - 1))
            v = affine.dequantize(affine.Quantized(packing.unpack(codes, self.bits, d), scale, offset),
                                  self.value_config)
        full = base.slot_tokens(st.v_full, index, pos % r % wv).astype(f32)
        v = jnp.where(where(pos[None, :] >= (lengths - r)[:, None]), full, v)
        return k, v

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Bits per cached K or V element, the mean over K and V.

        With `context_len` L: what KIVI holds at L tokens — ⌊L/R⌋·R keys at b + 2·meta_bits/key_group and
        L mod R at the residual dtype's bits; max(L − R, 0) values at b + 2·meta_bits/value_group and
        min(L, R) at the residual dtype's bits — per token. Without it: the long-context limit, codes and
        metadata only.
        """
        kb, vb = qbits.affine_bits(self.key_config), qbits.affine_bits(self.value_config)
        if context_len is None:
            return (kb + vb) / 2
        if isinstance(context_len, bool) or not isinstance(context_len, (int, np.integer)) or context_len < 1:
            raise ValueError(f"context_len must be a positive integer, got {context_len!r}")
        n, r = int(context_len), self.residual_length
        full = jnp.dtype(self.residual_dtype).itemsize * 8
        keys = n // r * r * kb + n % r * full
        values = max(n - r, 0) * vb + min(n, r) * full
        return (keys + values) / Fraction(2 * n)

    def describe(self) -> str:
        """E.g. "INT2 codes + fp16 meta, last 128 tokens fp16"."""
        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}
        return (f"INT{self.bits} codes + {short[self.meta_dtype]} meta, last {self.residual_length} tokens "
                f"{short[self.residual_dtype]}")


# Compiled once per format and shape, also when the model runs eagerly (under an outer jit it inlines).
_write = jax.jit(Kivi._write, static_argnums=0)
