"""Dense decode attention (Pallas, Triton backend): the baseline the quantized kernels are timed against.

The same flash-decoding machinery and partial outputs as `residual_attention`: queries [B, K, R, D]
(rows padded to >= 16), a slot's stored keys/values [B, K, S, D] picked from a stack [M, ...] inside the
kernel — or, with a block table, a pool of pages [M, NP, K, P, D] read page-indexed (`decode_common.Tokens`)
— per-row valid lengths, split-K with a log-sum-exp combine outside the kernel, and the unnormalised
partial (acc, m, l). Head dims that are not a power of two are loaded padded with masks.

Every dot runs on bfloat16 tensor cores with float32 operands split into bfloat16 hi + lo halves, the
precision path of the quantized kernels: a bfloat16 cache's entries are exact (two dots per product),
a float32 cache's are split as well (three dots, ~2^-16 relative, instead of HIGHEST-precision float32
dots, which Triton runs without tensor cores and which spilled).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode_common as dc
from pallas_kernels import launch

MAX_HEAD_DIM = 256
_STATIC = ("block_s", "num_splits", "block_r", "num_warps", "num_stages", "interpret")


def _kernel(slot_ref, len_ref, *refs, plan: dc.DecodePlan, rows: int, dim: int, page: int):
    table_ref = refs[0] if page else None
    q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs[1:] if page else refs
    slot, length = slot_ref[()], len_ref[()]
    r_blk, split = pl.program_id(2), pl.program_id(3)
    bs, br, dpad = plan.block_s, plan.block_r, q_ref.shape[-1]
    row_ok = (r_blk * br + jnp.arange(br)) < rows
    col_ok = (jnp.arange(dpad) < dim)[None, :]
    q = dc.load(q_ref, mask=row_ok[:, None] & col_ok, other=jnp.zeros((), q_ref.dtype))
    q_halves = dc.split_bf16(q)
    sm_scale = 1.0 / math.sqrt(dim)

    def body(t, carry):
        m_prev, l_prev, acc = carry
        t0 = t * bs
        tok_ok = (split * plan.split_len + t0 + jnp.arange(bs)) < length
        mask = tok_ok[:, None] & col_ok
        tok = dc.Tokens.of_tile(slot, t0, split, tok_ok, plan, table_ref, page)
        k = dc.load(k_ref.at[tok.at(pl.ds(0, dpad))], mask=mask, other=jnp.zeros((), k_ref.dtype))
        score = dc.dot_split(q_halves, dc.split_bf16(k), trans_b=True) * sm_scale
        score = jnp.where(tok_ok[None, :], score, -jnp.inf)
        p, m_new, l_new, corr = dc.online_softmax(score, m_prev, l_prev)
        v = dc.load(v_ref.at[tok.at(pl.ds(0, dpad))], mask=mask, other=jnp.zeros((), v_ref.dtype))
        acc = corr[:, None] * acc + dc.dot_split(dc.split_bf16(p), dc.split_bf16(v))
        return m_new, l_new, acc

    init = (jnp.full((br,), dc.NEG, jnp.float32), jnp.zeros((br,), jnp.float32),
            jnp.zeros((br, dpad), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, dc.num_tiles(length, split, plan), body, init)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def _check(q, k, v, lengths, block_table):
    if q.ndim != 4 or k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"want q [B, K, R, D], k = v [M, B, K, S, D] or a pool [M, NP, K, P, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, kh, r, d = q.shape
    dc.check_table(block_table, b, k.shape[:4], kh)
    if k.shape[4] != d:
        raise ValueError(f"cache {k.shape} does not match queries {q.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [{b}], got {lengths.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (kernel covers float32 and bfloat16)")
    if k.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != k.dtype:
        raise NotImplementedError(f"cache dtypes {k.dtype}/{v.dtype} (kernel covers bfloat16 and float32)")
    if d % 16 or d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} (kernel covers multiples of 16 up to {MAX_HEAD_DIM})")


@functools.partial(jax.jit, static_argnames=_STATIC)
def dense_decode_attention(
    q: jax.Array,          # [B, K, R, D] float32 | bfloat16
    k: jax.Array,          # [M, B, K, S, D] bfloat16 | float32; with block_table a pool [M, NP, K, P, D]
    v: jax.Array,          # k's shape and dtype
    lengths: jax.Array,    # [B] int32 valid stored tokens per row
    slot: jax.Array | int,  # [] int32: which of the M stacked slots
    block_table: jax.Array | None = None,  # [B, N'] int32 pool page of each row's logical page; None: contiguous
    *,
    block_s: int | None = None,
    num_splits: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial (acc [B, K, R, D], m, l [B, K, R], float32) of q over a slot's
    stored keys/values s < lengths[b] (row b's position s at offset s mod P of page block_table[b, s // P]
    when paged; entries past a row's length are never read); a row with no valid token gives m = -1e30,
    l = 0, acc = 0."""
    _check(q, k, v, lengths, block_table)
    b, kh, r, d = q.shape
    m_slots = k.shape[0]
    lengths, table, page, s = dc.paged_lengths(lengths, block_table, k.shape[:4])
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    lp = launch.lookup(f"dense-{jnp.dtype(k.dtype).name}", d, r, paged=bool(page))
    plan = dc.plan_decode(b, kh, r, s, block_s=block_s or dc.tile_block(lp.block_s, page), num_splits=num_splits,
                          block_r=block_r, num_warps=num_warps or lp.num_warps, num_stages=num_stages or lp.num_stages,
                          max_block_r=lp.max_block_r)
    dpad, br, sl = dc.next_pow2(d), plan.block_r, plan.split_len
    n_rb, ns = pl.cdiv(r, br), plan.num_splits
    if page:
        kv_spec = pl.BlockSpec((m_slots, k.shape[1], None, page, dpad), lambda b, k, r, j: (0, 0, k, 0, 0))
        table_specs, table_args = [pl.BlockSpec((None, table.shape[1]), lambda b, k, r, j: (b, 0))], [table]
    else:
        kv_spec = pl.BlockSpec((m_slots, None, None, sl, dpad), lambda b, k, r, j: (0, b, k, j, 0))
        table_specs, table_args = [], []
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, plan=plan, rows=r, dim=d, page=page),
        grid=(b, kh, n_rb, ns),
        in_specs=[dc.scalar_spec(), pl.BlockSpec((None,), lambda b, k, r, j: (b,)), *table_specs,
                  pl.BlockSpec((None, None, br, dpad), lambda b, k, r, j: (b, k, r, 0)), kv_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, None, None, br, dpad), lambda b, k, r, j: (b, k, j, r, 0)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r))],
        out_shape=[jax.ShapeDtypeStruct((b, kh, ns, n_rb * br, dpad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, ns, n_rb * br), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, ns, n_rb * br), jnp.float32)],
        compiler_params=dc.compiler_params(plan.num_warps, plan.num_stages),
        interpret=interpret,
        name="dense_decode_attention",
    )(jnp.asarray(slot, jnp.int32).reshape(()), lengths, *table_args, q, k, v)
    acc, m, l = dc.combine_splits(acc, m, l)
    return acc[:, :, :r, :d], m[:, :, :r], l[:, :, :r]


@functools.partial(jax.jit, static_argnames=_STATIC)
def dense_decode_attention_reference(q, k, v, lengths, slot, block_table=None, *, block_s=None, num_splits=None,
                                     block_r=None, num_warps=None, num_stages=None, interpret=False):
    """`dense_decode_attention` in plain jnp (float32, HIGHEST precision; a pool read as contiguous rows
    first); block arguments ignored."""
    del block_s, num_splits, block_r, num_warps, num_stages, interpret
    if block_table is not None:
        k, v = (dc.rows_of_pages(x, block_table) for x in (k, v))
    b, kh, r, d = q.shape
    s = k.shape[3]
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    hi = jax.lax.Precision.HIGHEST
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    score = jnp.einsum("bkrd,bksd->bkrs", q.astype(jnp.float32), k[slot].astype(jnp.float32), precision=hi)
    p, m, l = dc.masked_partial(score / math.sqrt(d), lengths)
    return jnp.einsum("bkrs,bksd->bkrd", p, v[slot].astype(jnp.float32), precision=hi), m, l
