"""Dense decode attention for TPUs (Pallas, Mosaic backend): bf16/f32 K/V read page by page through a block
table, the TPU twin of `dense_attention.dense_decode_attention`.

The contract is the GPU kernel's: queries [B, K, R, D] (R query rows per kv head: GQA groups times query
tokens), a slot's stored keys/values [B, K, S, D] picked from a stack [M, ...], per-row valid lengths, and the
unnormalised partial (acc [B, K, R, D], m, l [B, K, R], float32), with m = -1e30, l = 0, acc = 0 for a row
that has no valid token. The caller merges it with the current tokens' partial, as for the GPU kernel.

Paging, as the GPU and CPU kernels (the serving engine's pool). Without a block table the slot's cache is
contiguous, [M, B, K, S, D], read in pages of P = the launch table's block (or S when that is smaller). With
`block_table` [B, N] every cache operand is a pool [M, NP, K, P, D] of NP pages of P tokens, and row b's
position s is read from page block_table[b, s // P] (capacity N·P). Entries past a row's last valid page are
never read (they may hold anything); entries it reads are clipped into the pool.

The grid is (B, K, R / ROW_BLOCK, N): rows, kv heads and blocks of query rows (`tpu_launch.row_block`: a
prompt chunk's many rows in blocks, decode's in one) in parallel, the context axis sequential ("arbitrary")
with an online softmax held in VMEM scratch. Block table, lengths and slot arrive by scalar prefetch (SMEM), so the
K/V BlockSpecs' index maps look up the physical page of each step before its DMA; a step past the row's
length maps to the row's last valid page, which the pipeline does not fetch again, and skips its compute:
HBM traffic follows the valid length, not the capacity. No split-K: a TPU core runs its grid sequentially,
and batch x kv heads supply the parallel programs (megacore chips split them).

Tiles are [tokens, D] for head dims that are multiples of 128, and [D, tokens] otherwise (`transposed`): XLA:TPU
lays a [..., S, D] array whose D is not a multiple of 128 out D-major by default, and a [tokens, D] block of it
makes XLA copy and pad the whole cache before every call (measured on v5e and v6e at 4k tokens: temporaries of
0.67-4x the K/V cache at head dims 32-96); read transposed, the compiled call has none (head dims 64, 96, 128).

Precision, as the GPU kernels: every dot runs on bf16 operands with float32 accumulation, a float32 operand
split into bf16 hi + lo (`decode_common.split_bf16`, ~2^-16 relative; lo·lo dropped), so bf16 K/V entries are
exact and float32 ones carry ~2^-16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode_common as dc
from pallas_kernels import tpu_launch

MAX_HEAD_DIM = 256
#: Sublane tile of a block's token axis per K/V dtype (the second-to-last dim of a VMEM block).
SUBLANES = {"float32": 8, "bfloat16": 16}
LANES = 128
_STATIC = ("block_s", "generation", "interpret")
NT = (((1,), (1,)), ((), ()))  # dot_general dims: a [m, k] x b [n, k] -> [m, n]
NN = (((1,), (0,)), ((), ()))  # a [m, k] x b [k, n] -> [m, n]


def split_dot(a, b, dims) -> jax.Array:
    """float32 a·b for split operands (`dc.split_bf16`): bf16 dots with float32 accumulation, hi·hi + lo·hi
    + hi·lo."""
    (a_hi, a_lo), (b_hi, b_lo) = a, b

    def one(x, y):
        return jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)

    out = one(a_hi, b_hi)
    if a_lo is not None:
        out = out + one(a_lo, b_hi)
    if b_lo is not None:
        out = out + one(a_hi, b_lo)
    return out


def reset_partial(acc_sc, m_sc, l_sc) -> None:
    """Start an online softmax in VMEM scratch: m = NEG, l = 0, acc = 0."""
    m_sc[...] = jnp.full(m_sc.shape, dc.NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _kernel(slot_ref, len_ref, table_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, acc_sc, m_sc, l_sc, *,
            block_s: int, sm_scale: float, transposed: bool):
    del slot_ref, table_ref  # read by the index maps
    b, j = pl.program_id(0), pl.program_id(3)
    length = len_ref[b]

    pl.when(j == 0)(functools.partial(reset_partial, acc_sc, m_sc, l_sc))

    @pl.when(j * block_s < length)
    def _step():
        start = j * block_s
        # k, v tiles: [bs, D], or [D, bs] when `transposed`
        score = split_dot(dc.split_bf16(q_ref[...]), dc.split_bf16(k_ref[...]), NN if transposed else NT) * sm_scale
        tok = start + jax.lax.broadcasted_iota(jnp.int32, score.shape, 1)
        score = jnp.where(tok < length, score, -jnp.inf)
        m_prev = m_sc[...]  # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(score, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.exp(score - m_new)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = v_ref[...]
        # Tokens past the length (a page's tail, or the padding of a partial last block) may hold anything,
        # NaN included: zero them, since p = 0 does not cancel a NaN.
        v_tok = start + jax.lax.broadcasted_iota(jnp.int32, v.shape, 1 if transposed else 0)
        v = jnp.where(v_tok < length, v, jnp.zeros_like(v))
        acc_sc[...] = corr * acc_sc[...] + split_dot(dc.split_bf16(p), dc.split_bf16(v), NT if transposed else NN)

    @pl.when(j == pl.num_programs(3) - 1)
    def _store():
        acc_ref[...] = acc_sc[...]
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


def _check(q, k, v, lengths, block_table):
    if q.ndim != 4 or k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"want q [B, K, R, D], k = v [M, B, K, S, D] (or a pool [M, NP, K, P, D]); got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, kh, _, d = q.shape
    if k.shape[4] != d:
        raise ValueError(f"cache {k.shape} does not match queries {q.shape}")
    dc.check_table(block_table, b, k.shape, kh)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [{b}], got {lengths.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (kernel covers float32 and bfloat16)")
    if k.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != k.dtype:
        raise NotImplementedError(f"cache dtypes {k.dtype}/{v.dtype} (kernel covers bfloat16 and float32)")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} (kernel covers up to {MAX_HEAD_DIM})")


def page_of(row, j, len_ref, table_ref, *, page: int, n: int, paged: bool):
    """(pool page, 0) of row's logical page j through the prefetched table (`flat_table`), or (row, j) of a
    contiguous cache; a step past the row's last valid page re-maps there, which the pipeline does not fetch
    again. Non-negative operands, so lax.div (truncating) equals //, without the sign ops that floor division
    lowers to (their Mosaic rule asks the host device for its TPU generation)."""
    last = jnp.maximum(jax.lax.div(len_ref[row] + page - 1, page) - 1, 0)
    return (table_ref[row * n + jnp.minimum(j, last)], 0) if paged else (row, jnp.minimum(j, last))


def flat_table(table: jax.Array | None) -> jax.Array:
    """The block table [B, N] as the kernels' scalar-prefetch operand [B·N]; a contiguous call's placeholder."""
    return (jnp.zeros((1, 1), jnp.int32) if table is None else table).reshape(-1)


def transposed(dim: int) -> bool:
    """Whether the kernel reads K/V tiles as [D, tokens]: for head dims that are not a multiple of 128, whose
    [..., S, D] arrays XLA:TPU lays out D-major by default ({3,4,2,1,0}: tokens on the 128 lanes, no padding
    of D). A [tokens, D] block of such an array would make XLA relayout (copy and pad) the whole cache before
    every call; its [D, S] transpose is the same bytes, so the kernel takes `swapaxes(k, -1, -2)`."""
    return dim % LANES != 0


def page_size(s: int, d: int, kv_dtype, paged: bool, block_s: int | None, generation: str) -> int:
    """Tokens per page (= per grid step): a pool's P = `s` when `paged` (a block of the whole page axis, legal
    for any P); else `block_s` or the launch table's block, capped at S. NotImplementedError when a contiguous
    cache's page is not all of S and not a multiple of Mosaic's tile along the token axis: the K/V dtype's
    sublanes (8 float32, 16 bfloat16), or 128 lanes when the tiles are `transposed(d)`."""
    name = jnp.dtype(kv_dtype).name
    if paged:
        if block_s is not None and block_s != s:
            raise ValueError(f"block_s={block_s} contradicts the pool's pages of {s}")
        return s
    page = min(block_s or tpu_launch.lookup(generation, f"dense-{name}").block_s, s)
    tile = LANES if transposed(d) else SUBLANES[name]
    if page != s and page % tile:
        raise NotImplementedError(f"pages of {page} tokens: a {name} block at head dim {d} needs a multiple of {tile}")
    return page


@functools.partial(jax.jit, static_argnames=_STATIC)
def tpu_dense_decode_attention(
    q: jax.Array,          # [B, K, R, D] float32 | bfloat16
    k: jax.Array,          # [M, B, K, S, D] bfloat16 | float32, or a pool [M, NP, K, P, D] with block_table
    v: jax.Array,          # k's shape and dtype
    lengths: jax.Array,    # [B] int32 valid stored tokens per row
    slot: jax.Array | int,  # [] int32: which of the M stacked slots
    block_table: jax.Array | None = None,  # [B, N] int32 pool page of each row's logical page; None: contiguous
    *,
    block_s: int | None = None,
    generation: str | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial (acc [B, K, R, D], m, l [B, K, R], float32) of q over a slot's stored
    keys/values s < lengths[b], read page by page through `block_table` (module docstring); a row with no
    valid token gives m = -1e30, l = 0, acc = 0. `block_s` (contiguous cache only: the page) and the VMEM
    limit default to `tpu_launch`'s entry for `generation` (default: the default device's, else v5e);
    `interpret`: True or `pltpu.InterpretParams` runs the kernel in TPU interpret mode (on a CPU)."""
    _check(q, k, v, lengths, block_table)
    b, kh, r, d = q.shape
    lengths, table, pool_page, s = dc.paged_lengths(lengths, block_table, k.shape)
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    generation = generation or tpu_launch.default_generation()
    paged = table is not None
    page = page_size(k.shape[3], d, k.dtype, paged, block_s, generation)
    tr = transposed(d)
    n = table.shape[1] if paged else pl.cdiv(s, page)
    rb = tpu_launch.row_block(r)
    limit = tpu_launch.lookup(generation, f"dense-{jnp.dtype(k.dtype).name}").vmem_limit_bytes

    def kv_map(row, h, i, j, slot_ref, len_ref, table_ref):
        src, at = page_of(row, j, len_ref, table_ref, page=page, n=n, paged=paged)
        return (slot_ref[0], src, h, 0, at) if tr else (slot_ref[0], src, h, at, 0)

    def row_map(row, h, i, j, *_):
        return row, h, i, 0

    kv_spec = pl.BlockSpec((None, None, None, d, page) if tr else (None, None, None, page, d), kv_map)
    if tr:
        k, v = jnp.swapaxes(k, -1, -2), jnp.swapaxes(v, -1, -2)
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, block_s=page, sm_scale=1.0 / math.sqrt(d), transposed=tr),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, kh, pl.cdiv(r, rb), n),
            in_specs=[pl.BlockSpec((None, None, rb, d), row_map), kv_spec, kv_spec],
            out_specs=[pl.BlockSpec((None, None, rb, d), row_map), pl.BlockSpec((None, None, rb, 1), row_map),
                       pl.BlockSpec((None, None, rb, 1), row_map)],
            scratch_shapes=[pltpu.VMEM((rb, d), jnp.float32), pltpu.VMEM((rb, 1), jnp.float32),
                            pltpu.VMEM((rb, 1), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, kh, r, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=limit),
        interpret=interpret,
        name="tpu_dense_decode_attention",
    )(jnp.asarray(slot, jnp.int32).reshape(1), lengths, flat_table(table), q, k, v)
    return acc, m[..., 0], l[..., 0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def tpu_dense_decode_attention_reference(q, k, v, lengths, slot, block_table=None, *, block_s=None,
                                         generation=None, interpret=False):
    """`tpu_dense_decode_attention` in plain jnp (float32, HIGHEST precision): the slot's pages gathered
    through `block_table` into each row's logical order, then `dense_decode_attention_reference`'s softmax
    partial; block arguments ignored."""
    del block_s, generation, interpret
    _check(q, k, v, lengths, block_table)
    b, kh, r, d = q.shape
    lengths, table, _, s = dc.paged_lengths(lengths, block_table, k.shape)
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    if table is not None:
        k, v = dc.rows_of_pages(k, table), dc.rows_of_pages(v, table)
    ks, vs = k[slot], v[slot]  # [B, K, S, D]
    hi = jax.lax.Precision.HIGHEST
    vs = jnp.where((jnp.arange(s)[None, :] < lengths[:, None])[:, None, :, None], vs, 0)  # stale entries: any value
    score = jnp.einsum("bkrd,bksd->bkrs", q.astype(jnp.float32), ks.astype(jnp.float32), precision=hi)
    p, m, l = dc.masked_partial(score / math.sqrt(d), lengths)
    return jnp.einsum("bkrs,bksd->bkrd", p, vs.astype(jnp.float32), precision=hi), m, l
