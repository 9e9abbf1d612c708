"""The `residual_vq` format: two-stage residual vector quantization of cached K/V (RVQ.md), 2 bits/element.

Layout. Each stored head vector x [D] is divided by its slot's per-channel scale, split into D / group
groups of `group` (= 4) consecutive channels (D % group == 0, so a group never crosses a head), and
coded by two 4-bit indices: stage 1 the nearest of `n_codes` (≤ 16) codewords of C1, stage 2 the
nearest codeword of C2 for the stage-1 residual. The two indices share one byte, `i1 | i2 << 4`
(`rq_jax.quant.rvq.encode`), so the state is

    RVQSlot.k, RVQSlot.v: uint8 [G, N, B, K, S, D // group]      (8 bits / group = 2 bits / element)

and decoding is x̂ = (C1[i1] + C2[i2]) · scale (`rq_jax.quant.rvq.decode`). Nothing else is stored.
Every loop is its own group (G = loops of the segment), so a segment state is `(RVQSlot,)`.

Calibration (static state passed alongside the cache, never in it): `RVQCalib(k, v)`, one
`rq_jax.quant.rvq.RVQCodebooks` each for keys and values with leading [G, N] slot axes:

    c1, c2: float32 [G, N, n_codes, group]   one codebook pair per (loop, layer) slot, shared by its heads
    scale:  float32 [G, N, K, D]             per-channel RMS per (loop, layer, kv head)

Per-slot codebooks (rather than one per layer shared by loops) cost 2·n_codes·group floats per slot,
which is negligible side data, and follow the states' drift across loops; scales are per
(loop, layer, head) as RVQ.md asks. Codebooks and scales are side data: `bits_per_element` counts the
indices only, like every format's accounting in `rq_jax.quant.bits`.

Calibration policy. There is no data-free default: `default_calib` raises a ValueError saying how
to fit one, and a model call with this format and no calibration raises before tracing. Pass a fitted
`RVQCalib` (e.g. from `rq_jax.cache.fit_calib` on a dense cache of representative prompts), or let
`rq_jax.sampling.Sampler` fit one on each batch's own prompts (a dense prefill first, then `calibrate`).
`calibrate` uses only
tokens s < lengths[b]: it picks `calib_tokens` (at most B·S) positions evenly spaced over the valid
tokens of the batch — a strided subsample when there are more, an even repetition when there are
fewer — so padding never reaches the fit and shapes stay fixed (it jits). Each slot is fitted with
`rq_jax.quant.rvq.fit_rvq` (k-means++ with `restarts`, `iters` Lloyd steps, C2 fitted on stage-1
residuals with C1 frozen, seed `seed` folded with the slot index).

Attention (`attend`) works from the indices. Scores use a per-query look-up table over the byte:
q·x̂ = Σ_groups LUT[group, byte] with LUT[g, i1 | i2 << 4] = (q∘scale)_g·C1[i1] + (q∘scale)_g·C2[i2],
one gather per group and query instead of decoding K. Values decode V (two 16-row look-ups and an add
per group) and contract with the probabilities; the "probability-weighted codebook counts" alternative
needs a one-hot [S, D/group, 16] per stage (8× the decoded values) or a scatter-add, so it is not
cheaper in XLA. Building the table costs R·(D/group)·256 entries for R = T·H/K query rows per kv head;
decoding K costs S·D. `attend_path="auto"` takes the table when it is the cheaper one (S > 64·R, i.e.
decode steps over a long cache) and otherwise decodes K too ("decode": `base.tiled_attend`, which is
`base.reference_attend` a tile at a time). Either way the cache is read one context tile at a time.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from types import MappingProxyType
from typing import ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from rq_jax.cache import base
from rq_jax.quant import bits, rvq
from rq_jax.shapes import Lengths, NumNew, Queries, SlotKV, Visible

_PATHS = ("auto", "lut", "decode")
_NIBBLE = 16  # codes per stage addressable by a 4-bit index


class RVQSlot(NamedTuple):
    """Packed index bytes (i1 | i2 << 4) of keys and values, uint8 [G, N, B, K, S, D // group] each."""

    k: UInt8[Array, "g n b k s c"]
    v: UInt8[Array, "g n b k s c"]


class RVQCalib(NamedTuple):
    """Static calibration: codebooks c1, c2 [G, N, n_codes, group] and scales [G, N, K, D] for K and V."""

    k: rvq.RVQCodebooks
    v: rvq.RVQCodebooks


def _slot_books(books: rvq.RVQCodebooks, index: base.Index) -> rvq.RVQCodebooks:
    """Slot `index`'s codebooks with scale [K, 1, D], broadcastable to [B, K, S, D]."""
    return rvq.RVQCodebooks(books.c1[index], books.c2[index], books.scale[index][:, None, :])


def _pad_codes(codebook: Float[Array, "c g"]) -> Float[Array, "16 g"]:
    """A codebook padded with zero rows to the 16 entries a 4-bit index can address."""
    return jnp.zeros((_NIBBLE, codebook.shape[-1]), jnp.float32).at[: codebook.shape[0]].set(codebook)


def _encode_slots(x: Float[Array, "g n b k t d"], books: rvq.RVQCodebooks) -> UInt8[Array, "g n b k t c"]:
    """Encode every (loop, layer) slot of x with its own codebooks ([G, N]-leading `books`)."""
    def one(x, c1, c2, scale):
        return rvq.encode(x, rvq.RVQCodebooks(c1, c2, scale[:, None, :]))

    return jax.vmap(jax.vmap(one))(x, books.c1, books.c2, books.scale)


def calib_token_index(lengths: Lengths, max_len: int, count: int) -> Int[Array, "m"]:
    """`count` flat indices into [B, max_len], evenly spaced over the valid tokens s < lengths[b].

    Valid tokens are taken in (row, position) order; index i picks valid token
    floor((2i + 1)·n_valid / (2·count)). Depends only on `lengths`, so padding never enters. With no
    valid token at all it returns position 0 of row 0.
    """
    valid = (jnp.arange(max_len)[None, :] < lengths[:, None]).reshape(-1)
    order = jnp.argsort(~valid, stable=True)  # valid positions first, in order
    n_valid = jnp.maximum(jnp.sum(valid), 1)
    pick = ((2 * jnp.arange(count) + 1) * n_valid) // (2 * count)
    return order[pick]


@base.register("residual_vq")
@dataclasses.dataclass(frozen=True)
class ResidualVQ(base.CacheFormat):
    """Two-stage RVQ storage (2 bits/element by default) with codebooks fitted by `calibrate`.

    Policy: `n_codes` (≤ 16) codewords of `group` channels per stage; k-means with `restarts` k-means++
    restarts of `iters` Lloyd steps, seeded by `seed`; `calib_tokens` calibration tokens per slot (at
    most B·S of the calibration batch); `attend_path` "auto" | "lut" | "decode" (see module docstring).
    """

    n_codes: int = 16
    group: int = 4
    iters: int = 25
    restarts: int = 4
    seed: int = 0
    calib_tokens: int = 4096
    attend_path: str = "auto"
    name: str = dataclasses.field(default="residual_vq", init=False)
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=True, init=False)
    needs_data: bool = dataclasses.field(default=True, init=False)
    schedule_fields: ClassVar[tuple[str, ...]] = ("name", "n_codes", "group")
    calib_head_axes: ClassVar[Mapping[str, int]] = MappingProxyType({"scale": 2})

    def __post_init__(self):
        if not 1 <= self.n_codes <= _NIBBLE:
            raise ValueError(f"residual_vq n_codes must be in [1, 16] (4-bit indices), got {self.n_codes}")
        for field in ("group", "iters", "restarts", "calib_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"residual_vq {field} must be ≥ 1, got {getattr(self, field)}")
        if self.attend_path not in _PATHS:
            raise ValueError(f"residual_vq attend_path must be one of {_PATHS}, got {self.attend_path!r}")

    def _check_dim(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise ValueError(f"residual_vq group {self.group} must divide the head dim {head_dim}: a group "
                             "never crosses a head boundary")

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[RVQSlot]:
        """Zeroed index bytes, uint8 [G, N, B, K, S, D // group] for K and for V."""
        self._check_dim(head_dim)
        shape = (seg.groups, num_layers, batch, num_kv_heads, max_len, head_dim // self.group)
        return (RVQSlot(jnp.zeros(shape, jnp.uint8), jnp.zeros(shape, jnp.uint8)),)

    def default_calib(self, seg, num_layers, num_kv_heads, head_dim):
        """Always raises ValueError: residual_vq has no data-free calibration."""
        raise ValueError(
            "the residual_vq cache format needs calibration (codebooks and per-channel scales fitted on "
            "data) and has no data-free default: fit one with rq_jax.cache.fit_calib on a dense cache of "
            "representative prompts and pass it as calib=..., or generate with rq_jax.sampling.Sampler "
            "without calib, which fits the codebooks on each batch's prompt")

    def calibrate(self, seg, k: Float[Array, "g 1 n b k s d"], v: Float[Array, "g 1 n b k s d"],
                  lengths: Lengths) -> RVQCalib:
        """Fit per-slot codebooks [G, N, n_codes, group] and scales [G, N, K, D] on tokens s < lengths[b].

        Jit-able (fixed shapes); slots are fitted one after another (`lax.map`) to bound memory.
        """
        k, v = k[:, 0], v[:, 0]
        num_loops, num_layers, batch, heads, max_len, head_dim = k.shape
        self._check_dim(head_dim)
        index = calib_token_index(lengths, max_len, min(self.calib_tokens, batch * max_len))

        def tokens(x):  # [L, N, B, K, S, D] -> [L·N, M, K, D], valid tokens only
            x = jnp.moveaxis(x, 4, 3).reshape(num_loops * num_layers, batch * max_len, heads, head_dim)
            return x[:, index].astype(jnp.float32)

        points = jnp.concatenate([tokens(k), tokens(v)])  # [2·L·N, M, K, D]: keys' slots, then values'
        base_key = jax.random.key(self.seed)

        def fit(args):
            slot, x = args
            return rvq.fit_rvq(jax.random.fold_in(base_key, slot), x, self.n_codes, self.group,
                               self.restarts, self.iters)

        books = jax.lax.map(fit, (jnp.arange(points.shape[0]), points))
        books = jax.tree_util.tree_map(lambda a: a.reshape(2, num_loops, num_layers, *a.shape[1:]), books)
        return RVQCalib(*(jax.tree_util.tree_map(lambda a, i=i: a[i], books) for i in (0, 1)))

    def reconstruct(self, state: tuple[RVQSlot], index: base.Index, loop: int, lengths: Lengths,
                    calib: RVQCalib) -> tuple[SlotKV, SlotKV]:
        """The stored K, V of slot `index` decoded to float32 [B, K, S, D] (0 at s ≥ lengths[b])."""
        slot, valid = base.at(state[0], index), base.valid_tokens(lengths, state[0].k.shape[base.TOKEN_AXIS])
        return tuple(jnp.where(valid[:, None, :, None], rvq.decode(codes, _slot_books(books, index)), 0.0)
                     for codes, books in ((slot.k, calib.k), (slot.v, calib.v)))

    def attend(self, state: tuple[RVQSlot], index: base.Index, loop: int, q: Queries,
               lengths: Lengths, calib: RVQCalib, visible: Visible | None = None,
               table: base.Table | None = None) -> base.Partial:
        """Partial attention of q [B, T, H, D] to the stored tokens s < lengths[b] of slot `index` (those
        `visible` [B, S] shows), one context tile at a time (`base.tiled_partial`).

        Equals `base.reference_attend` to float tolerance; scores come from per-query byte tables, built
        once, then looked up by each tile's key bytes; each tile's values are decoded.
        """
        b, t, h, d = q.shape
        heads, groups = state[0].k.shape[3], state[0].k.shape[5]
        max_len = base.tiling(state[0].k, table, b, t, h, d)[0]
        rows = t * (h // heads)
        use_lut = self.attend_path == "lut" or (self.attend_path == "auto" and max_len * self.group > _NIBBLE**2 * rows)
        if not use_lut:
            return base.tiled_attend(self, state, index, loop, q, lengths, calib, visible, table)
        books = calib.k
        # Per-query tables: qs[b, t, k, g, G, j] = q·scale/sqrt(D) over group G; LUT over the code byte.
        qs = base.group_queries(q.astype(jnp.float32), heads) * books.scale[index][:, None, :] * d**-0.5
        qs = qs.reshape(b, t, heads, h // heads, groups, self.group)
        lut1, lut2 = (jnp.einsum("btkhGj,cj->bktGhc", qs, _pad_codes(c[index])) for c in (books.c1, books.c2))
        lut = (lut2[..., :, None] + lut1[..., None, :]).reshape(b, heads, t, groups, -1, _NIBBLE**2)
        value_books = _slot_books(calib.v, index)
        # The gathered table entries dominate a tile (a page, when paged).
        tile = base.tiling(state[0].k, table, b, t * groups, h, d)[1]

        def part(state, start, valid):
            slot = base.slot_tile(state[0], index, start, tile, table)
            # scores[b, k, t, h, s] = Σ_G lut[b, k, t, G, h, byte[b, k, s, G]]
            codes = jnp.moveaxis(slot.k.astype(jnp.int32), -1, 2)  # [B, K, G, S]
            gathered = jnp.take_along_axis(lut, codes[:, :, None, :, None, :], axis=-1)  # [B, K, T, G, Hg, S]
            scores = jnp.moveaxis(jnp.sum(gathered, axis=3), 1, 2).reshape(b, t, h, tile)
            p, m, l = base.softmax_partial(scores, jnp.broadcast_to(valid[:, None, :], (b, t, tile)))
            values = rvq.decode(slot.v, value_books)  # [B, K, S, D]
            acc = jnp.einsum("btkgs,bksd->btkgd", p.reshape(b, t, heads, -1, tile), values)
            return base.Partial(acc.reshape(b, t, h, d), m, l)

        return base.tiled_partial(part, state, (b, t, h, d), lengths, max_len, tile, visible)

    def write(self, state: tuple[RVQSlot], k: Float[Array, "g 1 n b k t d"], v: Float[Array, "g 1 n b k t d"],
              lengths: Lengths, num_new: NumNew, calib: RVQCalib, table: base.Table | None = None) -> base.Written:
        """Encode the new K/V [G, 1, N, B, K, T, D] of every slot at once; store t < num_new[b] at lengths[b] + t."""
        new = RVQSlot(_encode_slots(k[:, 0], calib.k), _encode_slots(v[:, 0], calib.v))
        return base.Written((base.scatter_tokens(state[0], new, lengths, num_new, table),), base.nothing_lost(lengths))

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Two 4-bit indices per group: 8 / group bits (2 for groups of 4); codebooks/scales excluded."""
        self._check_dim(head_dim)
        return bits.rvq_bits(self.n_codes, self.group, 2)

    def schedule_name(self, num_loops: int) -> str:
        """E.g. "residual_vq-n16-g4-L4"."""
        return f"{self.name}-n{self.n_codes}-g{self.group}-L{num_loops}"

    def describe(self) -> str:
        return f"2×{self.n_codes} codewords of {self.group} dims (4-bit indices), fitted codebooks"
