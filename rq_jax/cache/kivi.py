"""The `kivi` format: KIVI's 2-bit baseline (keys per channel over token groups, values per token).

Keys are quantized **per channel**: the g = `key_group` consecutive tokens of a group share one
(scale, offset) pair per channel. A group can only be quantized once all its g tokens exist, so the
newest tokens of a row, whose group is not full yet, stay in a full-precision **tail** (as in KIVI) and
are quantized together the moment the group fills — possibly several groups in one prefill call.
Values are quantized **per token** as soon as they are written, in groups of `value_group` consecutive
channels. Both use the toolbox's asymmetric affine quantizer (`rq_jax.quant.affine`, round half down,
metadata in `meta_dtype`) with plain min/max ranges (`clip` = 1.0, as KIVI) and planar-packed codes.

KIVI's optional recent window (`window` = W > 0, off by default as in the paper's comparisons) keeps
the W most recent tokens' K and V additionally in full precision; attention reads those tokens from
the window instead of their quantized copies.

State layout (`KiviState`, every loop its own group, so one slot per group position with leading
axes [G, N] = [loops, layers]; S = max_len, J = S // g complete key groups that fit, Sq = J·g,
P = packed bytes per row = D·bits/8)::

    k_codes  uint8 [G, N, B, K, Sq, P]      channel-packed key codes of complete groups
    k_scale  meta  [G, N, B, K, J, D]       per (token group, channel)
    k_offset meta  [G, N, B, K, J, D]
    k_tail   res   [G, N, B, K, g, D]       full-precision keys of the open group: position s at s % g
    v_codes  uint8 [G, N, B, K, S, P]
    v_scale  meta  [G, N, B, K, S, D // gv] per (token, channel group)
    v_offset meta  [G, N, B, K, S, D // gv]
    win_k    res   [G, N, B, K, W, D]       (None when W = 0) ring: position s at s % W
    win_v    res   [G, N, B, K, W, D]

`max_len` need not be a multiple of g: the last S − Sq positions can never form a complete group
(tokens past the cache are dropped), so they only ever live in the tail and get no code storage.
Row b holds quantized keys for s < ⌊length_b / g⌋·g and its tail for the rest.

Accounting: `bits_per_element` counts codes and metadata only (b + 2·meta_bits/g for K and for V);
the tail and the window are excluded there but included in the cache's bytes.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from rq_jax.cache import base
from rq_jax.quant import affine, packing
from rq_jax.quant import bits as qbits

_RESIDUAL_DTYPES = ("bfloat16", "float16", "float32")


class KiviState(NamedTuple):
    """Quantized K/V of every (loop, layer) slot; see the module docstring for the layout."""

    k_codes: UInt8[Array, "l n b k sq p"]
    k_scale: Array
    k_offset: Array
    k_tail: Array
    v_codes: UInt8[Array, "l n b k s p"]
    v_scale: Array
    v_offset: Array
    win_k: Array | None
    win_v: Array | None


def _take_tokens(x: Array, index: Int[Array, "b m"]) -> Array:
    """Per-row token gather: x [G, N, B, K, T, D], index [B, M] -> [G, N, B, K, M, D] (x[..., b, :, index[b], :])."""
    l, n, b, k, _, d = x.shape
    idx = jnp.broadcast_to(index[None, None, :, None, :, None], (l, n, b, k, index.shape[1], d))
    return jnp.take_along_axis(x, idx, axis=4)


@base.register("kivi")
@dataclasses.dataclass(frozen=True)
class Kivi:
    """KIVI policy. `bits` ∈ {1, 2, 3, 4, 8} for keys and values; `key_group` tokens per key group
    (per channel); `value_group` channels per value group (per token, must divide head_dim);
    `meta_dtype` of scales/offsets ("float8_e4m3fn", "bfloat16", "float16", "float32"); `residual_dtype`
    of the full-precision tail and window ("bfloat16", "float16", "float32"); `window` recent tokens kept
    in full precision (0 = none); `clip` range factor in (0, 1] (1 = KIVI's plain min/max).
    `group_size`, if given, sets both groups (it is then folded into them and reads None)."""

    bits: int = 2
    key_group: int = 32
    value_group: int = 32
    meta_dtype: str = "float8_e4m3fn"
    residual_dtype: str = "bfloat16"
    window: int = 0
    clip: float = 1.0
    group_size: int | None = None
    name: str = dataclasses.field(default="kivi", init=False)
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        def positive_int(field, value, minimum=1):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"kivi {field} must be an integer >= {minimum}, got {value!r}")

        if self.group_size is not None:
            positive_int("group_size", self.group_size)
            for field in ("key_group", "value_group", "group_size"):
                object.__setattr__(self, field, None if field == "group_size" else self.group_size)
        quantized_bits = tuple(b for b in affine.VALID_BITS if b != affine.PASSTHROUGH_BITS)
        if self.bits not in quantized_bits:
            raise ValueError(f"kivi bits must be one of {quantized_bits}, got {self.bits!r}")
        positive_int("key_group", self.key_group)
        positive_int("value_group", self.value_group)
        positive_int("window", self.window, minimum=0)
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
        if not isinstance(self.clip, (int, float)) or not 0.0 < float(self.clip) <= 1.0:
            raise ValueError(f"kivi clip must lie in (0, 1], got {self.clip!r}")

    @property
    def key_config(self) -> affine.QuantConfig:
        """The key quantizer: groups of `key_group` tokens of one channel."""
        return affine.QuantConfig(self.bits, self.key_group, meta_dtype=self.meta_dtype, clip=self.clip)

    @property
    def value_config(self) -> affine.QuantConfig:
        """The value quantizer: groups of `value_group` channels of one token."""
        return affine.QuantConfig(self.bits, self.value_group, meta_dtype=self.meta_dtype, clip=self.clip)

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[KiviState]:
        """An empty segment state, [G, N] slots of [B, K, S, D] (layout in the module docstring).

        Raises ValueError if head_dim is not divisible by `value_group` or cannot be packed at `bits`.
        """
        if head_dim % self.value_group:
            raise ValueError(f"kivi value_group {self.value_group} must divide head_dim {head_dim}")
        try:
            p = packing.packed_dim(head_dim, self.bits)
        except ValueError as e:
            raise ValueError(f"kivi bits={self.bits} cannot pack head_dim {head_dim}: {e}") from None
        lead = (seg.groups, num_layers, batch, num_kv_heads)
        g, groups = self.key_group, max_len // self.key_group
        meta, res = jnp.dtype(self.meta_dtype), jnp.dtype(self.residual_dtype)
        win = None if not self.window else jnp.zeros((*lead, self.window, head_dim), res)
        return (KiviState(
            k_codes=jnp.zeros((*lead, groups * g, p), jnp.uint8),
            k_scale=jnp.zeros((*lead, groups, head_dim), meta),
            k_offset=jnp.zeros((*lead, groups, head_dim), meta),
            k_tail=jnp.zeros((*lead, g, head_dim), res),
            v_codes=jnp.zeros((*lead, max_len, p), jnp.uint8),
            v_scale=jnp.zeros((*lead, max_len, head_dim // self.value_group), meta),
            v_offset=jnp.zeros((*lead, max_len, head_dim // self.value_group), meta),
            win_k=win, win_v=win),)

    def default_calib(self, seg, num_layers, num_kv_heads, head_dim) -> None:
        """KIVI needs no calibration."""
        return None

    def calibrate(self, seg, k, v, lengths) -> None:
        """KIVI needs no calibration."""
        return None

    def write(self, state: tuple[KiviState], k: Float[Array, "g 1 n b k t d"], v: Float[Array, "g 1 n b k t d"],
              lengths: Int[Array, "b"], num_new: Int[Array, "b"], calib) -> tuple[KiviState]:
        """Store new K/V [G, 1, N, B, K, T, D], tokens t < num_new[b] at positions lengths[b] + t.

        Values are quantized at once. New keys join the row's open group (the tail); every group this
        fills — up to ⌈T / g⌉ of them — is quantized, and the new open group becomes the tail.
        Tokens past max_len are dropped. Fixed shapes, no per-row or per-token Python loop.
        """
        return (_write(self, state[0], k[:, 0], v[:, 0], lengths, num_new),)

    def _write(self, state: KiviState, k, v, lengths, num_new) -> KiviState:
        """`write`'s body, compiled by `_write` below with the policy static."""
        l, n, b, kh, t, d = k.shape
        g, res = self.key_group, jnp.dtype(self.residual_dtype)
        room = state.v_codes.shape[4] - lengths
        num_new = jnp.clip(num_new, 0, jnp.maximum(room, 0))  # never write past the cache

        vq = affine.quantize(v, self.value_config)
        v_codes, v_scale, v_offset = base.scatter_tokens(
            (state.v_codes, state.v_scale, state.v_offset), (packing.pack(vq.codes, self.bits), vq.scale, vq.offset),
            lengths, num_new)

        # Staging: the open group (its first `fill` tokens are real) followed by the new tokens.
        fill = lengths % g
        groups = -(-t // g)  # most groups one call can complete: ⌈T / g⌉
        staging = jnp.zeros((l, n, b, kh, (groups + 1) * g, d), res).at[:, :, :, :, :g].set(state.k_tail)
        staging = base.scatter_tokens(staging, k.astype(res), fill, num_new)
        kq = affine.quantize(staging[:, :, :, :, : groups * g].reshape(l, n, b, kh, groups, g, d).swapaxes(-1, -2),
                             self.key_config)  # per channel: codes [..., groups, D, g], meta [..., groups, D, 1]
        codes = packing.pack(kq.codes.swapaxes(-1, -2).reshape(l, n, b, kh, groups * g, d), self.bits)
        done = (fill + num_new) // g  # groups completed by this call
        k_codes = base.scatter_tokens(state.k_codes, codes, lengths - fill, done * g)
        k_scale, k_offset = base.scatter_tokens((state.k_scale, state.k_offset), (kq.scale[..., 0], kq.offset[..., 0]),
                                                lengths // g, done)
        k_tail = _take_tokens(staging, done[:, None] * g + jnp.arange(g)[None, :])
        open_slots = jnp.arange(g)[None, :] < ((lengths + num_new) % g)[:, None]  # zero the rest: a canonical state
        k_tail = jnp.where(open_slots[None, None, :, None, :, None], k_tail, 0)

        win_k, win_v = state.win_k, state.win_v
        if self.window:
            # Ring slot i takes the newest new token at a position ≡ i (mod W), if any.
            w = self.window
            last = lengths + num_new - 1
            src = num_new[:, None] - 1 - (last[:, None] - jnp.arange(w)[None, :]) % w  # [B, W]
            take = (src >= 0)[None, None, :, None, :, None]
            src = jnp.maximum(src, 0)
            win_k = jnp.where(take, _take_tokens(k.astype(res), src), win_k)
            win_v = jnp.where(take, _take_tokens(v.astype(res), src), win_v)

        return KiviState(k_codes, k_scale, k_offset, k_tail, v_codes, v_scale, v_offset, win_k, win_v)

    def attend(self, state: tuple[KiviState], index: base.Index, loop: int, q: Float[Array, "b t h d"],
               lengths: Int[Array, "b"], calib) -> base.Partial:
        """Partial attention (float32) of q [B, T, H, D] to the stored tokens s < lengths[b] of a slot.

        Works from the codes: key scores q·k̂_s = Σ_c q_c·o_{j,c} + Σ_c (q_c·σ_{j,c})·code_{s,c} for s in
        complete group j (scale folded into the query), the tail's full-precision keys for the open
        group; value output Σ_s p_s·v̂_s = Σ_s (p_s·σ_{s,grp})·code_s + Σ_s p_s·o_{s,grp} (scale folded
        into the probabilities). Window tokens (s ≥ lengths − W) form a second, dense partial.
        """
        return _attend_slot(self, base.at(state[0], index), q, lengths)

    def _attend_slot(self, st: KiviState, q, lengths) -> base.Partial:
        """`attend` on one slot's arrays ([B, K, ...]), compiled by `_attend_slot` below."""
        b, t, h, d = q.shape
        kh, g, s_len = st.k_tail.shape[1], self.key_group, st.v_codes.shape[2]
        f32 = jnp.float32
        qg = base.group_queries(q.astype(f32), kh) * d**-0.5  # [B, T, K, H/K, D], 1/sqrt(D) folded in

        groups = st.k_scale.shape[2]
        k_codes = packing.unpack(st.k_codes, self.bits, d).astype(f32).reshape(b, kh, groups, g, d)
        quant = (jnp.einsum("btkhd,bkjd,bkjid->btkhji", qg, st.k_scale.astype(f32), k_codes)
                 + jnp.einsum("btkhd,bkjd->btkhj", qg, st.k_offset.astype(f32))[..., None])
        quant = jnp.pad(quant.reshape(*quant.shape[:4], groups * g),
                        ((0, 0),) * 4 + ((0, s_len - groups * g),))
        pos = jnp.arange(s_len)
        tail = jnp.einsum("btkhd,bkid->btkhi", qg, st.k_tail.astype(f32))[..., pos % g]
        in_tail = (pos[None, :] >= (lengths - lengths % g)[:, None])[:, None, None, None, :]
        scores = jnp.where(in_tail, tail, quant).reshape(b, t, h, s_len)

        p, m, l = base.softmax_partial(scores, base.past_mask(lengths - self.window, t, s_len))
        gv = self.value_group
        v_codes = packing.unpack(st.v_codes, self.bits, d).astype(f32).reshape(b, kh, s_len, d // gv, gv)
        pk = p.reshape(b, t, kh, h // kh, s_len)
        acc = (jnp.einsum("btkhs,bksj,bksjc->btkhjc", pk, st.v_scale.astype(f32), v_codes)
               + jnp.einsum("btkhs,bksj->btkhj", pk, st.v_offset.astype(f32))[..., None])
        out = base.Partial(acc.reshape(b, t, h, d), m, l)
        if self.window:
            mask = jnp.broadcast_to((jnp.arange(self.window)[None, :] < lengths[:, None])[:, None, :],
                                    (b, t, self.window))
            out = base.merge(out, base.dense_partial(q, st.win_k.astype(f32), st.win_v.astype(f32), mask))
        return out

    def reconstruct(self, state: tuple[KiviState], index: base.Index, loop: int, lengths: Int[Array, "b"], calib
                    ) -> tuple[Float[Array, "b k s d"], Float[Array, "b k s d"]]:
        """The stored K, V of slot (loop, layer) as float32 [B, K, S, D]: dequantized groups, the
        full-precision tail for the open group, window tokens from the window; zero past each row's length."""
        st = base.at(state[0], index)
        b, kh, g, d = st.k_tail.shape
        s_len, groups = st.v_codes.shape[2], st.k_scale.shape[2]
        codes = packing.unpack(st.k_codes, self.bits, d).reshape(b, kh, groups, g, d).swapaxes(-1, -2)
        kq = affine.dequantize(affine.Quantized(codes, st.k_scale[..., None], st.k_offset[..., None]),
                               self.key_config).swapaxes(-1, -2).reshape(b, kh, groups * g, d)
        kq = jnp.pad(kq, ((0, 0), (0, 0), (0, s_len - groups * g), (0, 0)))
        vq = affine.dequantize(affine.Quantized(packing.unpack(st.v_codes, self.bits, d), st.v_scale, st.v_offset),
                               self.value_config)
        pos = jnp.arange(s_len)[None, None, :, None]
        length = lengths[:, None, None, None]
        k = jnp.where(pos < length - length % g, kq, st.k_tail.astype(jnp.float32)[:, :, pos[0, 0, :, 0] % g])
        k, v = jnp.where(pos < length, k, 0.0), jnp.where(pos < length, vq, 0.0)
        if self.window:
            ring = pos[0, 0, :, 0] % self.window
            recent = (pos >= length - self.window) & (pos < length)
            k = jnp.where(recent, st.win_k.astype(jnp.float32)[:, :, ring], k)
            v = jnp.where(recent, st.win_v.astype(jnp.float32)[:, :, ring], v)
        return k, v

    def bits_per_element(self, num_loops: int, head_dim: int) -> Fraction:
        """Bits per cached K or V element, codes + metadata: the mean of b + 2·meta_bits/key_group (K)
        and b + 2·meta_bits/value_group (V). The tail and window are excluded (counted in the cache's bytes)."""
        return (qbits.affine_bits(self.key_config) + qbits.affine_bits(self.value_config)) / 2


# Compiled once per format and shape, also when the model runs eagerly (under an outer jit they inline).
_write = jax.jit(Kivi._write, static_argnums=0)
_attend_slot = jax.jit(Kivi._attend_slot, static_argnums=0)
