"""Machinery shared by the decode-attention kernels: Triton-backend compatibility, the split-K plan
(split count per shape; block sizes and warps come from `pallas_kernels.launch`), in-kernel helpers,
and the log-sum-exp combine of the splits.

Every kernel here is flash-decoding: the grid is (batch, kv head, query-row block, split); each program
walks its split of the stored sequence tile by tile with an online softmax and writes an unnormalised
partial (acc, m, l); `combine_splits` merges the splits outside the kernel. The caller merges that
partial with the current tokens' one (a log-sum-exp merge), so nothing is normalised here.

Triton constraints this module encodes: power-of-two tile shapes; dot operands at least 16 along every
dimension (query rows are padded to >= 16); no value slicing or concatenation inside a kernel (slice
refs instead, with masked loads where a slice runs past the real data); scalar prefetch does not exist
on the Triton backend, so a stacked operand's slot is picked by offsetting its ref inside the kernel
(`ref.at[slot]`: pointer arithmetic, no copy).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# jax >= 0.11 warns at every Triton-backend lowering that the backend is deprecated; JAX's own Pallas
# tests filter exactly this message. Nothing else is silenced.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", category=DeprecationWarning, message=TRITON_DEPRECATION)

_CompilerParams = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
dot = getattr(pltriton, "dot", None) or pl.dot  # pl.dot is deprecated in favour of the triton module's
load = pltriton.load
store = pltriton.store

#: Finite "minus infinity" of the running max: a row that saw no valid token keeps m = NEG, l = 0 and
#: acc = 0, and every merge stays finite (exp(NEG - NEG) = 1 multiplies zeros).
NEG = -1e30


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params. Always passed: without them jax 0.10 routes a GPU pallas_call to Mosaic GPU."""
    return _CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


# ---- the split-K plan ---------------------------------------------------------------------------------

#: Programs the split count aims for: ~4 per SM of an H100/H200 (132 SMs), so even batch 1 with few kv
#: heads keeps the whole GPU streaming.
TARGET_PROGRAMS = 512
#: A split holds at least this many tiles, so the per-program setup (query pieces, stores) stays small
#: against its streaming loop.
MIN_TILES_PER_SPLIT = 4
#: Query rows per program at most; more rows get more programs along the row-block grid axis.
MAX_BLOCK_R = 64


class DecodePlan(NamedTuple):
    """Static tiling of one decode-attention call.

    block_s: tokens per tile (the online-softmax step); split_len: tokens per split (a multiple of
    block_s); num_splits: splits along the sequence (ceil(S / split_len)); block_r: query rows per
    program (>= 16, a power of two); num_warps, num_stages: Triton launch parameters.
    """

    block_s: int
    split_len: int
    num_splits: int
    block_r: int
    num_warps: int
    num_stages: int


def plan_decode(batch: int, kv_heads: int, rows: int, seq_len: int, *, block_s: int,
                num_splits: int | None = None, block_r: int | None = None, num_warps: int = 4,
                num_stages: int = 2, max_block_r: int = MAX_BLOCK_R) -> DecodePlan:
    """Choose the split count and row block for a [batch, kv_heads, rows] x seq_len decode call.

    block_r (default): the rows rounded up to a power of two >= 16, at most max_block_r (more rows get
    more programs along the row-block grid axis).

    num_splits (default): the power of two that brings batch * kv_heads * row_blocks * splits to
    about TARGET_PROGRAMS, capped so every split still has MIN_TILES_PER_SPLIT tiles. The plan is
    static (it depends on the cache capacity, not on the valid lengths): splits past a row's length
    exit at once.
    """
    if block_s < 16 or block_s != next_pow2(block_s):
        raise NotImplementedError(f"block_s={block_s}: Triton needs a power of two >= 16")
    block_r = block_r or min(next_pow2(max(rows, 16)), max_block_r)
    if block_r < 16 or block_r != next_pow2(block_r):
        raise NotImplementedError(f"block_r={block_r}: Triton needs a power of two >= 16")
    tiles = max(1, math.ceil(seq_len / block_s))
    if num_splits is None:
        programs = batch * kv_heads * math.ceil(rows / block_r)
        want = next_pow2(math.ceil(TARGET_PROGRAMS / max(programs, 1)))
        num_splits = max(1, min(want, tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(int(num_splits), tiles))
    split_len = math.ceil(tiles / num_splits) * block_s
    num_splits = math.ceil(max(seq_len, 1) / split_len)
    return DecodePlan(block_s, split_len, num_splits, block_r, num_warps, num_stages)


# ---- in-kernel helpers ------------------------------------------------------------------------------


def split_bf16(x: jax.Array, exact: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """x as hi + lo, both bfloat16, to ~2^-16 relative (lo is None when x is bfloat16 already or the
    caller knows it `exact` in bfloat16): a float32 operand of a tensor-core dot at ~16 mantissa bits
    instead of tf32's 10."""
    if x.dtype == jnp.bfloat16:
        return x, None
    hi = x.astype(jnp.bfloat16)
    return hi, None if exact else (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def dot_split(a: tuple[jax.Array, jax.Array | None], b: tuple[jax.Array, jax.Array | None], *,
              trans_b: bool = False) -> jax.Array:
    """float32 a @ b (or a @ b.T) for split operands `a = split_bf16(x)`, `b = split_bf16(y)`: bf16 dots
    with float32 accumulation, hi·hi + lo·hi + hi·lo (lo·lo is below 2^-16 relative and dropped), so
    one dot when both are exact in bfloat16, two when one is, three otherwise."""
    (a_hi, a_lo), (b_hi, b_lo) = a, b
    out = dot(a_hi, b_hi, trans_b=trans_b)
    if a_lo is not None:
        out = out + dot(a_lo, b_hi, trans_b=trans_b)
    if b_lo is not None:
        out = out + dot(a_hi, b_lo, trans_b=trans_b)
    return out


def float8_e4m3fn_bits_to_f32(bits: jax.Array) -> jax.Array:
    """float8_e4m3fn values from their uint8 bits, exactly, with integer ops only: the Triton lowering
    casts float8 only from sm_89 on, so Ampere needs this path, and one path serves every target.
    sign · (e == 0 ? m : (8 + m) << (e - 1)) · 2^-9 (e: 4-bit exponent, m: 3-bit mantissa). The NaN
    pattern (e = 15, m = 7) reads 480; rq_jax's writer clips metadata to ±448, so it never stores one."""
    x = bits.astype(jnp.int32)
    e, m = (x >> 3) & 15, x & 7
    mag = jnp.where(e == 0, m, (m + 8) << jnp.maximum(e - 1, 0)).astype(jnp.float32) * (2.0 ** -9)
    return jnp.where(x >= 128, -mag, mag)


def float16_bits_to_f32(bits: jax.Array) -> jax.Array:
    """float16 values from their uint16 bits, exactly, with integer ops only (Mosaic loads no float16 vector):
    a normal number's exponent rebiased into float32's bits (e + 112; 31, the infinities and NaNs, to 255),
    the 10-bit mantissa shifted up 13; a subnormal (e = 0) is m · 2^-24."""
    x = bits.astype(jnp.int32)
    e, m = (x >> 10) & 31, x & 1023
    normal = jax.lax.bitcast_convert_type(((x >> 15) << 31) | (jnp.where(e == 31, 255, e + 112) << 23) | (m << 13),
                                          jnp.float32)
    tiny = m.astype(jnp.float32) * (2.0 ** -24)
    return jnp.where(e == 0, jnp.where(x >= 1 << 15, -tiny, tiny), normal)


def online_softmax(scores: jax.Array, m_prev: jax.Array, l_prev: jax.Array):
    """One flash step on a [rows, tile] score tile (masked entries -inf, at least one finite per
    processed tile): returns p = exp(scores - m_new), m_new, l_new and the correction exp(m_prev - m_new)
    that rescales the running accumulator."""
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.exp(scores - m_new[:, None])
    return p, m_new, corr * l_prev + jnp.sum(p, axis=1), corr


def num_tiles(length: jax.Array, split: jax.Array, plan: DecodePlan) -> jax.Array:
    """Tiles of this split that hold a valid token: clamp(ceil((length - split start) / block_s))."""
    left = length - split * plan.split_len
    return jnp.clip((left + plan.block_s - 1) // plan.block_s, 0, plan.split_len // plan.block_s)


class Tokens(NamedTuple):
    """Where a tile's block_s tokens lie in a cache operand, as ref indices: `at(*rest)` for a [bs, ...] read
    whose trailing index is a slice or scalars, `gather(cols)` for a [bs, len(cols)] read of arbitrary
    channel indices.

    Contiguous (a stack [M, S', ...] whose BlockSpec already offsets it to the program's split): (slot, the
    tile's slice). Paged (a pool [M, NP, P, ...] seen whole; the page of logical page n is the row's block
    table [N'] at n, clipped into the pool by the caller):
      - a tile inside one page (block_s divides P, `tile_block`'s choice for a power-of-two P >= 16): (slot,
        its page, the tile's slice of it), the contiguous code with one scalar lookup per tile;
      - else per token its page and offset, integer indexers that Triton turns into per-token pointers, so a
        tile may span pages of any size; a channel slice becomes an integer indexer too (interpret mode does
        not mix integer arrays with slices)."""

    lead: tuple
    rows: tuple
    gathered: bool = False

    @staticmethod
    def of_tile(slot, t0, split, tok_ok, plan: "DecodePlan", table_ref=None, page: int = 0) -> "Tokens":
        """The tokens of the tile starting at t0 of `split`; `table_ref` and `page` (tokens per page) for a
        pool. A tile starts before the row's length (`num_tiles`), so its first token's page is in the table;
        per-token pages of tokens past the length (`tok_ok` false) read page 0, and every load masks them."""
        bs = plan.block_s
        if table_ref is None:
            return Tokens((slot, pl.ds(t0, bs)), (slot, (t0 + jnp.arange(bs))[:, None]))
        start = split * plan.split_len + t0
        if page % bs == 0:
            at, off = table_ref[start // page], start % page
            return Tokens((slot, at, pl.ds(off, bs)), (slot, at, (off + jnp.arange(bs))[:, None]))
        pos = start + jnp.arange(bs)
        pages = load(table_ref.at[pos // page], mask=tok_ok, other=jnp.zeros((), table_ref.dtype))
        return Tokens((slot, pages, pos % page), (slot, pages[:, None], (pos % page)[:, None]), True)

    def at(self, *rest) -> tuple:
        if self.gathered and rest and isinstance(rest[-1], pl.Slice):
            return self.gather(rest[-1].start + jnp.arange(rest[-1].size))
        return (*self.lead, *rest)

    def gather(self, cols: jax.Array) -> tuple:
        return (*self.rows, cols[None, :])


def tile_block(block_s: int, page: int) -> int:
    """Tokens per tile of a call with the launch table's `block_s` over pages of `page` tokens (0: contiguous):
    at most a page when the page is a power of two >= 16, so each tile lies inside one page (`Tokens`)."""
    if page >= 16 and page == next_pow2(page):
        return min(block_s, page)
    return block_s


def paged_lengths(lengths: jax.Array, block_table: jax.Array | None, stored: tuple[int, ...]):
    """(lengths clipped to the capacity, the clipped table or None, tokens per page (0: contiguous), capacity
    S) of a call whose cache operand has leading axes `stored`: [M, B, K, S] contiguous, or a pool
    [M, NP, K, P] with `block_table` [B, N'] (capacity N'·P; entries clipped into the pool's NP pages)."""
    if block_table is None:
        return jnp.clip(lengths.astype(jnp.int32), 0, stored[3]), None, 0, stored[3]
    page, s = stored[3], block_table.shape[1] * stored[3]
    table = jnp.clip(block_table.astype(jnp.int32), 0, stored[1] - 1)
    return jnp.clip(lengths.astype(jnp.int32), 0, s), table, page, s


def rows_of_pages(x: jax.Array, block_table: jax.Array) -> jax.Array:
    """A pool [M, NP, K, P, ...] read through `block_table` [B, N'] as contiguous rows [M, B, K, N'·P, ...]
    (the references' view of a paged call; entries clipped into the pool)."""
    pages = jnp.take(x, jnp.clip(block_table, 0, x.shape[1] - 1), axis=1)  # [M, B, N', K, P, ...]
    pages = jnp.moveaxis(pages, 2, 3)
    return pages.reshape(*pages.shape[:3], -1, *pages.shape[5:])


def check_table(block_table: jax.Array | None, batch: int, stored: tuple[int, ...], kv_heads: int) -> None:
    """ValueError unless the cache's leading axes `stored` fit a call of `batch` rows and `kv_heads` heads:
    [M, batch, kv_heads, S] contiguous, or a pool [M, NP, kv_heads, P] with an integer `block_table`
    [batch, N']."""
    if block_table is None:
        if tuple(stored[1:3]) != (batch, kv_heads):
            raise ValueError(f"cache batch/heads {tuple(stored[1:3])} != queries' {(batch, kv_heads)} "
                             "(a paged pool needs a block_table)")
    elif (block_table.ndim != 2 or block_table.shape[0] != batch
          or not jnp.issubdtype(block_table.dtype, jnp.integer)):
        raise ValueError(f"block_table must be integer [{batch}, N], got {block_table.dtype}{list(block_table.shape)}")
    elif stored[2] != kv_heads:
        raise ValueError(f"pool kv heads {stored[2]} != queries' {kv_heads}")


def scalar_spec() -> pl.BlockSpec:
    """A 0-d operand (the slot index) seen whole by every program."""
    return pl.BlockSpec((), lambda *_: ())


# ---- outside the kernel -----------------------------------------------------------------------------


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array):
    """Log-sum-exp merge of per-split partials along axis 2.

    acc: [B, K, splits, R, D]; m, l: [B, K, splits, R]. Returns acc [B, K, R, D], m, l [B, K, R].
    Splits that saw no token carry m = NEG, l = 0, acc = 0 and drop out (weight exp(NEG - m) = 0), or,
    when no split saw one, give m = NEG, l = 0, acc = 0.
    """
    m_all = jnp.max(m, axis=2)
    w = jnp.exp(m - m_all[:, :, None])
    return (jnp.sum(acc * w[..., None], axis=2), m_all, jnp.sum(l * w, axis=2))


def empty_partial(b: int, k: int, r: int, d: int):
    """The partial of no tokens at all: acc = 0, m = NEG, l = 0."""
    return (jnp.zeros((b, k, r, d), jnp.float32), jnp.full((b, k, r), NEG, jnp.float32),
            jnp.zeros((b, k, r), jnp.float32))


def masked_partial(scores: jax.Array, lengths: jax.Array):
    """Reference softmax partial of scores [B, K, R, S] over s < lengths[b]: (p, m, l), float32."""
    valid = jnp.arange(scores.shape[-1])[None, :] < lengths[:, None]  # [B, S]
    valid = valid[:, None, None, :]
    scores = jnp.where(valid, scores, NEG)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)
