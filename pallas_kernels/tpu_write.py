"""One decode token per row stored in place into a token-minor cache leaf on a TPU (Pallas, Mosaic backend).

XLA:TPU lays a cache leaf [..., B, K, S, C] whose channel count C is not a multiple of 128 (packed codes, FP8
or bf16 metadata) out with the tokens on the 128 lanes, and α [..., B, K, S] with the heads on the sublanes
(`tpu_residual_attention`'s layout). Its scatter of one token into such a leaf is not in place for most of
them: measured at Ouro-1.4B widths on v5e, 4 layers, batch 8, 4k tokens, XLA flattened every 64-byte code leaf
and every FP8 metadata leaf to one dimension, scattered there and copied back, 146 MiB of temporaries against
an 817 MiB cache, growing with the context (docs/performance.md, "TPU").

The kernel takes the leaf transposed to [A, R, K, C, S] (A: the leading axes merged; R: rows, or a pool's
pages) — the layout XLA stores, so the transpose is no copy — aliased to its output and left in HBM. Per
(a, b) it copies the [K, C, 128] block of lanes that holds row b's position into VMEM, puts the new token in
its lane and copies the block back: the step's traffic is one 128-token block per row and leaf, whatever S
is. A contiguous leaf's row b is R's row b, at position lengths[b]; a pool's is page block_table[b, p // P]
at p % P (p = lengths[b]). Rows with num_new[b] = 0, or whose position is past their capacity, touch
nothing (they are dropped, never wrapped around): a padding row's table may name a page another row writes.
Destinations and positions arrive by scalar prefetch; the grid runs in order ("arbitrary"), one step's copy
back done before the next starts.

The select runs on the values' bits widened to int32 (a float bitcast, in the kernel, to the unsigned integer
of its width), which Mosaic has on every generation, and is exact; FP8 leaves enter as they are (a bitcast to
uint8 outside the kernel is materialised by XLA:TPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def covers(old_shape: tuple[int, ...], new_tokens: int, token_axis: int, dtype) -> str | None:
    """Why `tpu_write_token` does not cover a leaf `old_shape` ([..., R, K, S] or [..., R, K, S, C], tokens on
    `token_axis`; a pool's pages of S tokens) written `new_tokens` at a time, or None when it does."""
    trailing = len(old_shape) - token_axis - 1
    s = old_shape[token_axis]
    if new_tokens != 1:
        return f"{new_tokens} tokens a call (the kernel stores one: a decode step)"
    if token_axis < 2 or trailing > 1:
        return f"leaf of shape {old_shape}, tokens on axis {token_axis} (covers [..., B, K, S] and [..., B, K, S, C])"
    if trailing and old_shape[-1] % LANES == 0:
        return f"{old_shape[-1]} channels, a multiple of {LANES}: XLA:TPU stores such a leaf token-major"
    if s % LANES and s > LANES:
        return f"S = {s}, not a multiple of {LANES} (the kernel's blocks are whole {LANES}-token lanes)"
    if jnp.dtype(dtype).itemsize not in _UINT:
        return f"dtype {jnp.dtype(dtype).name}"
    return None


def destinations(lengths: jax.Array, num_new: jax.Array, capacity: int,
                 block_table: jax.Array | None = None, pages: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(row or page [B], position in it [B], whether the row stores [B]) of each row's token: row b at
    lengths[b] of a contiguous leaf of `capacity` positions; with `block_table` [B, N], page
    block_table[b, p // capacity] (clipped into the pool's `pages`) at p % capacity. A row stores when
    num_new[b] > 0 and its position lies inside its capacity (capacity · N for a pool)."""
    lengths = lengths.astype(jnp.int32)
    if block_table is None:
        return jnp.arange(lengths.shape[0], dtype=jnp.int32), lengths, (num_new > 0) & (lengths < capacity)
    logical = lengths // capacity
    cols = block_table.shape[1]
    page = jnp.take_along_axis(block_table.astype(jnp.int32), jnp.minimum(logical, cols - 1)[:, None], axis=1)[:, 0]
    return jnp.clip(page, 0, pages - 1), lengths % capacity, (num_new > 0) & (logical < cols)


def _int32(x: jax.Array) -> jax.Array:
    """x's bits as int32 (a float as the unsigned integer of its width, then widened)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return x.astype(jnp.int32)


def _kernel(dest_ref, pos_ref, store_ref, new_ref, old_hbm, out_hbm, buf, sem, *, lanes: int):
    del old_hbm  # aliased to out_hbm: read and written there
    a, b = pl.program_id(0), pl.program_id(1)

    @pl.when(store_ref[b] != 0)
    def _store():
        pos = pos_ref[b]
        start = jax.lax.div(pos, lanes) * lanes  # a non-negative position: lax.div is //
        block = out_hbm.at[a, dest_ref[b], ..., pl.ds(pl.multiple_of(start, lanes), lanes)]
        fetch = pltpu.make_async_copy(block, buf, sem)
        fetch.start()
        fetch.wait()
        lane = start + jax.lax.broadcasted_iota(jnp.int32, buf.shape, buf.ndim - 1)
        bits = jnp.where(lane == pos, jnp.broadcast_to(_int32(new_ref[...]), buf.shape), _int32(buf[...]))
        dtype = buf.dtype
        if jnp.issubdtype(dtype, jnp.floating):
            bits = jax.lax.bitcast_convert_type(bits.astype(_UINT[dtype.itemsize]), dtype)
        buf[...] = bits.astype(dtype)
        back = pltpu.make_async_copy(buf, block, sem)
        back.start()
        back.wait()


@functools.partial(jax.jit, static_argnames=("token_axis", "interpret"), donate_argnums=0)
def tpu_write_token(
    old: jax.Array,        # [..., R, K, S] or [..., R, K, S, C], tokens on token_axis (C not a multiple of 128);
                           # with block_table a pool: R pages of S tokens
    new: jax.Array,        # [..., B, K, 1(, C)]: row b's token
    lengths: jax.Array,    # [B] int32: row b's token goes to position lengths[b]
    num_new: jax.Array,    # [B] int32: 0 leaves row b as it was
    block_table: jax.Array | None = None,  # [B, N] int32 pool page of each row's logical page; None: contiguous
    *,
    token_axis: int,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`old` with row b's token stored at position lengths[b] (through `block_table` for a pool) where
    num_new[b] > 0 and the position lies inside the row's capacity, in place (module docstring). ValueError
    names a leaf `covers` declines."""
    why = covers(old.shape, new.shape[token_axis], token_axis, old.dtype)
    if why:
        raise ValueError(f"tpu_write_token: {why}")
    lead, chans = old.shape[:token_axis - 2], old.shape[token_axis + 1:]
    r, k, s = old.shape[token_axis - 2:token_axis + 1]
    b = new.shape[token_axis - 2]
    if block_table is None and b != r:
        raise ValueError(f"tpu_write_token: {b} rows of new tokens for a leaf of {r} rows (a pool needs a block_table)")
    a = math.prod(lead)

    def tokens_last(x):  # [A, R, K, (C,) S]: the layout XLA:TPU stores, no copy
        return jnp.moveaxis(x.reshape(a, x.shape[token_axis - 2], k, x.shape[token_axis], *chans), 3, -1)

    lanes = min(s, LANES)
    dest, pos, store = destinations(lengths, num_new, s, block_table, r)
    zeros = (0,) * len(chans)
    out = pl.pallas_call(
        functools.partial(_kernel, lanes=lanes),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(a, b),
            in_specs=[pl.BlockSpec((None, None, k, *chans, 1), lambda ai, bi, *_: (ai, bi, 0, *zeros, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((k, *chans, lanes), old.dtype), pltpu.SemaphoreType.DMA],
        ),
        out_shape=jax.ShapeDtypeStruct((a, r, k, *chans, s), old.dtype),
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="tpu_write_token",
    )(dest, pos, store.astype(jnp.int32), tokens_last(new.astype(old.dtype)), tokens_last(old))
    return jnp.moveaxis(out, -1, 3).reshape(old.shape)


@functools.partial(jax.jit, static_argnames=("token_axis", "interpret"))
def tpu_write_token_reference(old, new, lengths, num_new, block_table=None, *, token_axis: int, interpret=False):
    """`tpu_write_token` as one jnp scatter of the values' bits (XLA:CPU's float scatter would quiet NaN
    payloads): row b's token at its destination (`destinations`) where it stores; the rest dropped."""
    del interpret
    dtype = old.dtype
    if jnp.issubdtype(dtype, jnp.floating):
        uint = _UINT[dtype.itemsize]
        bits = tpu_write_token_reference(jax.lax.bitcast_convert_type(old, uint),
                                         jax.lax.bitcast_convert_type(new.astype(dtype), uint), lengths, num_new,
                                         block_table, token_axis=token_axis)
        return jax.lax.bitcast_convert_type(bits, dtype)
    row_axis = token_axis - 2
    dest, pos, store = destinations(lengths, num_new, old.shape[token_axis], block_table, old.shape[row_axis])
    pos = jnp.where(store, pos, old.shape[token_axis])  # S is dropped
    moved = jnp.moveaxis(jnp.moveaxis(old, token_axis, 0), row_axis + 1, 1)  # [S, R, ...]
    vals = jnp.moveaxis(jnp.moveaxis(new.astype(dtype), token_axis, 0), row_axis + 1, 1)[0]  # [B, ...]
    moved = moved.at[pos, dest].set(vals, mode="drop")
    return jnp.moveaxis(jnp.moveaxis(moved, 1, row_axis + 1), 0, token_axis)
