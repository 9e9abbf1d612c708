"""Decode attention over a packed ResidualQuant chain for TPUs (Pallas, Mosaic backend), read page by page
through a block table: the TPU twin of `residual_attention.residual_decode_attention`.

The math and the contract are the GPU kernel's (its module docstring): the rotated queries q [B, K, R, D]
of one loop attend to a slot's stored tokens s < lengths[b] through the loop's reference chain (the loop's
own link first, the anchor last), each link a packed stream of codes with per-group scale/offset,

    score_s = ( Σ_i (Π_{j<i} αk_{j,s}) · (q · D(ck_{i,s}) + mean_score_i) ) / sqrt(D)
    acc     = Σ_s exp(score_s − m) · Σ_i (Π_{j<i} αv_{j,s}) · D(cv_{i,s}),   D(c) = offset + scale · code,

and the output is the unnormalised partial (acc [B, K, R, D], m, l [B, K, R], float32), m = -1e30, l = 0,
acc = 0 for a row with no valid token. Paging is the GPU kernel's (the serving engine's pool): contiguous
streams [M, B, K, S, ...] read in pages of P tokens (the launch table's block, halved to fit VMEM), or with
`block_table` [B, N] pools [M, NP, K, P, ...] whose page block_table[b, s // P] holds row b's position s.
The page of each step arrives by scalar prefetch, and steps past a row's length re-map to its last valid page
(no DMA) and skip their compute.

The grid is (B, R / ROW_BLOCK, N): rows and blocks of query rows (`tpu_launch.row_block`) in parallel, pages
sequential under an online softmax in VMEM scratch, and one step
holds every kv head of its page (a loop over heads inside), because α [M, B, K, S] is stored with the heads
on the sublanes: a block of one head's α row is not a legal Mosaic block, and a relayout of α to make it one
is a copy per call. Tiles are token-minor, [channels, tokens]: codes [K, J, P] (J = D·bits/8 bytes per
token), scale/offset [K, D/g, P], α [K, P]. XLA:TPU stores [..., S, C] arrays whose last dim C is not a
multiple of 128 with the tokens on the 128 lanes (as a dense cache of such head dims,
`tpu_dense_attention.transposed`), so the wrapper's `swapaxes` is that layout, not a copy, and P must be a
multiple of 128 (or all of S: a pool's page of any size). Codes rows of a multiple of 128 bytes (INT8 at head
dim 128, INT4/INT8 at 256) XLA stores token-major: those are read as [tokens, J] tiles and transposed in VMEM
(`token_major`).
Metadata arrays with very few groups may be stored with the group axis above the heads (measured: 2 FP8 or 6
bf16 groups per token at 16 heads), which costs a copy of that metadata (not of the codes) per call.

In VMEM a link's codes are widened to int32 and unpacked plane by plane with shifts and masks (plane k of
byte j is channel kJ + j, so the planes stacked along the sublanes are the channels in order), its metadata
repeated over each group's channels, and the chain reconstructed as one float32 [D, P] tile per stream,
ẑ = D(c_0) + α_0 ⊙ (D(c_1) + α_1 ⊙ ...): keys enter one split dot q · ẑ_k (the key means as
Σ_i (Π_{j<i} αk_j) · mean_score_i, the GPU kernel's `dequant_keys` path), values one split dot p · ẑ_vᵀ.
FP8-e4m3 metadata is loaded as it is stored, bitcast to uint8 in the kernel and decoded with integer ops
(`decode_common.float8_e4m3fn_bits_to_f32`): no float8 arithmetic is assumed of Mosaic, and a bitcast outside
the kernel would be materialised by XLA:TPU (a copy of every metadata leaf per call). float16 metadata cannot
be loaded so (Mosaic has no float16 vector, nor a bitcast of a float16 block): it enters as its uint16 bits,
bitcast outside the kernel, where XLA:TPU may copy it, and is decoded with integer ops
(`decode_common.float16_bits_to_f32`).

Precision, as the GPU kernels: bf16 dot operands with float32 accumulation, float32 operands (the
reconstructed tiles, p, float32 queries) split into bf16 hi + lo (~2^-16 relative, lo·lo dropped).

Layout (rq_jax's, as the GPU kernel's; M stacks the slots):
    codes  uint8 [M, B, K, S, D·bits/8], planar packing, bits ∈ {1, 2, 4, 8}
    scale, offset [M, B, K, S, D/g]  float8_e4m3fn | bfloat16 | float32
    alpha  [M, B, K, S] bfloat16 | float32 (link i's α scales link i + 1), or None (α = 1)
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode_common as dc
from pallas_kernels import residual_attention as ra
from pallas_kernels import tpu_launch
from pallas_kernels.tpu_dense_attention import LANES, NN, NT, flat_table, page_of, reset_partial, split_dot

QuantStream = ra.QuantStream
SUPPORTED_BITS = (1, 2, 4, 8)
SUPPORTED_META = ("float8_e4m3fn", "bfloat16", "float16", "float32")
SUPPORTED_ALPHA = ("bfloat16", "float32")
MAX_HEAD_DIM = 256
#: float32 sublanes: the unpacked planes (J rows each) and metadata groups (g rows) are stacked along the
#: sublane axis of int32/float32 tiles, which Mosaic does at multiples of 8 rows.
SUBLANES = 8
LAUNCH_KERNEL = "residual"
_STATIC = ("k_bits", "v_bits", "k_group_sizes", "v_group_sizes", "block_s", "generation", "interpret")


def _links(streams, bits, groups, dim: int, what: str) -> tuple[ra.Link, ...]:
    """`residual_attention.chain_links`, and what the TPU kernel does not cover by name: planes or groups of
    channels not a multiple of 8, metadata dtypes other than SUPPORTED_META (or scale and offset apart)."""
    links = ra.chain_links(streams, bits, groups, dim, what, SUPPORTED_BITS)
    for i, ln in enumerate(links):
        if ln.bits < 8 and ln.nbytes % SUBLANES:
            raise NotImplementedError(f"{what} link {i}: {ln.bits}-bit planes of {ln.nbytes} channels at head dim "
                                      f"{dim} (TPU kernel stacks planes of multiples of {SUBLANES})")
        if ln.group % SUBLANES:
            raise NotImplementedError(f"{what} link {i}: group size {ln.group} (TPU kernel covers multiples of "
                                      f"{SUBLANES})")
        if ln.meta not in SUPPORTED_META or streams[i].offset.dtype != streams[i].scale.dtype:
            raise NotImplementedError(f"{what} link {i}: metadata dtypes {streams[i].scale.dtype}/"
                                      f"{streams[i].offset.dtype} (TPU kernel covers {SUPPORTED_META})")
    return links


def _check(q, keys, values, k_alpha, v_alpha, mean_scores, lengths, block_table):
    ra.check_chain(q, lengths, keys, values, k_alpha, v_alpha, mean_scores, block_table)
    d = q.shape[3]
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (TPU kernel covers float32 and bfloat16)")
    if d % SUBLANES or d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} (TPU kernel covers multiples of {SUBLANES} up to {MAX_HEAD_DIM})")
    for a in (*k_alpha, *v_alpha):
        if a is not None and jnp.dtype(a.dtype).name not in SUPPORTED_ALPHA:
            raise NotImplementedError(f"alpha dtype {a.dtype} (TPU kernel covers {SUPPORTED_ALPHA})")


def page_size(s: int, paged: bool, block_s: int | None, generation: str, step_bytes_per_token: int,
              row_bytes: int = 0) -> int:
    """Tokens per page (= per grid step): a pool's P = `s` when `paged` (a block of the whole page axis, legal
    for any P); else `block_s`, or the launch table's block halved (down to 128) while the double-buffered
    inputs of a step (`step_bytes_per_token`: every head's codes, metadata and α of one token) and its
    query-row buffers (`row_bytes`, whatever the page) would pass half the VMEM limit; capped at S.
    NotImplementedError when a contiguous page is neither all of S nor a multiple of 128 (the tokens lie on
    the lanes of every tile)."""
    if paged:
        if block_s is not None and block_s != s:
            raise ValueError(f"block_s={block_s} contradicts the pool's pages of {s}")
        return s
    if block_s is not None:
        page = min(block_s, s)
    else:
        entry = tpu_launch.lookup(generation, LAUNCH_KERNEL)
        page = entry.block_s
        while page > LANES and 2 * page * step_bytes_per_token + row_bytes > entry.vmem_limit_bytes // 2:
            page //= 2
        page = min(page, s)
    if page != s and page % LANES:
        raise NotImplementedError(f"pages of {page} tokens: the packed TPU kernel needs a multiple of {LANES}")
    return page


# ---- the kernel ----------------------------------------------------------------------------------


def _meta_f32(raw: jax.Array, meta: str) -> jax.Array:
    """Loaded metadata as float32: FP8 (e4m3fn) decoded from its bits, bitcast in the kernel; float16 from its
    uint16 bits (bitcast outside: Mosaic loads no float16 vector)."""
    if meta == "float8_e4m3fn":
        return dc.float8_e4m3fn_bits_to_f32(jax.lax.bitcast_convert_type(raw, jnp.uint8).astype(jnp.int32))
    if meta == "float16":
        return dc.float16_bits_to_f32(raw)
    return raw.astype(jnp.float32)


def token_major(link: ra.Link) -> bool:
    """Whether a link's codes are read as [tokens, J] tiles: rows of a multiple of 128 bytes (INT8 at head
    dim 128, INT4/INT8 at 256), which XLA:TPU stores with the bytes on the lanes."""
    return link.nbytes % LANES == 0


def _dequantized(refs, link: ra.Link, h) -> jax.Array:
    """D(c) [D, P] float32 of head h's tiles of one link: codes [J, P] uint8 (read as [P, J] and transposed
    for a `token_major` link) unpacked plane by plane (plane k holds channels [kJ, (k+1)J)), plus offset +
    scale [D/g, P] repeated over each group's g channels."""
    c_ref, s_ref, o_ref = refs
    raw = c_ref[h].astype(jnp.int32)
    if token_major(link):
        raw = raw.T
    if link.bits < 8:
        mask = (1 << link.bits) - 1
        raw = jnp.concatenate([(raw >> (k * link.bits)) & mask for k in range(8 // link.bits)], axis=0)
    page = raw.shape[1]

    def per_channel(ref):  # [D/g, P] -> [D, P]
        x = _meta_f32(ref[h], link.meta)
        return jnp.broadcast_to(x[:, None, :], (link.ngroups, link.group, page)).reshape(link.dim, page)

    return per_channel(o_ref) + per_channel(s_ref) * raw.astype(jnp.float32)


def _kernel(*refs, k_links, v_links, k_has_alpha, v_has_alpha, has_mean, page: int, sm_scale: float):
    it = iter(refs)
    next(it), next(it)  # slot, block table: read by the index maps
    len_ref, q_ref = next(it), next(it)
    k_refs = [(next(it), next(it), next(it)) for _ in k_links]
    ka_refs = [next(it) if has else None for has in k_has_alpha]
    v_refs = [(next(it), next(it), next(it)) for _ in v_links]
    va_refs = [next(it) if has else None for has in v_has_alpha]
    mean_ref = next(it) if any(has_mean) else None
    acc_ref, m_ref, l_ref, acc_sc, m_sc, l_sc = (next(it) for _ in range(6))
    alpha_sc = list(it)  # one float32 [K, P] per α operand, in ka_refs then va_refs order
    heads = q_ref.shape[0]
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    pl.when(j == 0)(functools.partial(reset_partial, acc_sc, m_sc, l_sc))

    @pl.when(j * page < length)
    def _step():
        # α tiles [K, P] as float32 once per step: head h's row is then a dynamic one-sublane load, which
        # Mosaic proves aligned for 32-bit data only.
        f32_alpha = iter(alpha_sc)
        k_alpha = [None if ref is None else next(f32_alpha) for ref in ka_refs]
        v_alpha = [None if ref is None else next(f32_alpha) for ref in va_refs]
        for ref, sc in zip((*ka_refs, *va_refs), (*k_alpha, *v_alpha)):
            if ref is not None:
                sc[...] = ref[...].astype(jnp.float32)
        tok = j * page + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
        ok = tok < length  # [1, P]

        def head(h, carry):
            def alpha(sc):  # [1, P]
                return sc[pl.ds(h, 1), :]

            def chain(stream_refs, links, alphas):  # ẑ_0 [D, P]: ẑ_i = D(c_i) + α_i ⊙ ẑ_{i+1}, anchor first
                z = _dequantized(stream_refs[-1], links[-1], h)
                for i in reversed(range(len(links) - 1)):
                    z = _dequantized(stream_refs[i], links[i], h) + (z if alphas[i] is None else alpha(alphas[i]) * z)
                return z

            score = split_dot(dc.split_bf16(q_ref[h]), dc.split_bf16(chain(k_refs, k_links, k_alpha)), NN)  # [R, P]
            if mean_ref is not None:  # Σ_i (Π_{j<i} αk_j) · mean_i
                coef, means = None, None
                for i, has in enumerate(has_mean):
                    if has:
                        mu = mean_ref[h, i]  # [R, 1]
                        term = mu if coef is None else mu * coef
                        means = term if means is None else means + term
                    if i + 1 < len(k_links) and k_alpha[i] is not None:
                        coef = alpha(k_alpha[i]) if coef is None else coef * alpha(k_alpha[i])
                score = score + means
            # Tokens past the length (a page's tail, an edge block's padding) may hold anything, NaN included.
            score = jnp.where(ok, score * sm_scale, -jnp.inf)
            m_prev = m_sc[h]  # [R, 1]
            m_new = jnp.maximum(m_prev, jnp.max(score, axis=1, keepdims=True))
            corr = jnp.exp(m_prev - m_new)
            p = jnp.exp(score - m_new)
            l_sc[h] = corr * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            m_sc[h] = m_new
            z = jnp.where(ok, chain(v_refs, v_links, v_alpha), 0.0)  # p = 0 does not cancel a NaN
            acc_sc[h] = corr * acc_sc[h] + split_dot(dc.split_bf16(p), dc.split_bf16(z), NT)
            return carry

        jax.lax.fori_loop(0, heads, head, 0)

    @pl.when(j == pl.num_programs(2) - 1)
    def _store():
        acc_ref[...] = acc_sc[...]
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


# ---- the public function ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=_STATIC)
def tpu_residual_decode_attention(
    q: jax.Array,                             # [B, K, R, D] float32 | bfloat16, rotated key basis
    keys: Sequence[QuantStream],              # chain links, the loop first and the anchor last
    values: Sequence[QuantStream],            # the same chain for values
    k_alpha: Sequence[jax.Array | None],      # len(keys) - 1 entries: [M, B, K, S] (a pool: [M, NP, K, P]) bf16 | f32,
                                              # or None (α = 1)
    v_alpha: Sequence[jax.Array | None],      # len(values) - 1 entries
    mean_scores: Sequence[jax.Array | None] | None,  # per key link: q·μ_i [B, K, R] float32, or None
    lengths: jax.Array,                       # [B] int32 valid stored tokens per row
    slot: jax.Array | int,                    # [] int32: which of the M stacked slots
    block_table: jax.Array | None = None,     # [B, N] int32 pool page of each row's logical page; None: contiguous
    *,
    k_bits: tuple[int, ...] | None = None,    # per key link; None: read from the shapes
    v_bits: tuple[int, ...] | None = None,
    k_group_sizes: tuple[int, ...] | None = None,
    v_group_sizes: tuple[int, ...] | None = None,
    block_s: int | None = None,
    generation: str | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial (acc [B, K, R, D], m, l [B, K, R], float32; rotated value basis) of q
    over a slot's packed stored tokens s < lengths[b], read page by page through `block_table` (module
    docstring); a row with no valid token gives m = -1e30, l = 0, acc = 0. NotImplementedError (at trace time)
    names what the kernel does not cover. `block_s` (contiguous cache only: the page) and the VMEM limit
    default to `tpu_launch`'s "residual" entry for `generation` (default: the default device's, else v5e);
    `interpret`: True or `pltpu.InterpretParams` runs the kernel in TPU interpret mode (on a CPU)."""
    keys, values, k_alpha, v_alpha = tuple(keys), tuple(values), tuple(k_alpha), tuple(v_alpha)
    _check(q, keys, values, k_alpha, v_alpha, mean_scores, lengths, block_table)
    b, kh, r, d = q.shape
    k_links = _links(keys, k_bits, k_group_sizes, d, "keys")
    v_links = _links(values, v_bits, v_group_sizes, d, "values")
    lengths, table, _, s = dc.paged_lengths(lengths, block_table, keys[0].codes.shape)
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    alphas = [a for a in (*k_alpha, *v_alpha) if a is not None]
    step_bytes = kh * (sum(ln.nbytes + 2 * ln.ngroups * jnp.dtype(ln.meta).itemsize for ln in (*k_links, *v_links))
                       + sum(a.dtype.itemsize for a in alphas))
    generation = generation or tpu_launch.default_generation()
    paged = table is not None
    rb = tpu_launch.row_block(r)
    # float32 [K, rows, D]: the query block and the acc output, double-buffered, and the acc scratch
    page = page_size(keys[0].codes.shape[3], paged, block_s, generation, step_bytes, row_bytes=5 * kh * rb * d * 4)
    n = table.shape[1] if paged else pl.cdiv(s, page)
    limit = tpu_launch.lookup(generation, LAUNCH_KERNEL).vmem_limit_bytes

    def stream_map(row, i, j, slot_ref, table_ref, len_ref):
        src, at = page_of(row, j, len_ref, table_ref, page=page, n=n, paged=paged)
        return slot_ref[0], src, 0, 0, at

    def alpha_map(row, i, j, slot_ref, table_ref, len_ref):
        src, at = page_of(row, j, len_ref, table_ref, page=page, n=n, paged=paged)
        return slot_ref[0], src, 0, at

    def row_map(row, i, j, *_):
        return row, 0, i, 0

    def token_major_map(row, i, j, *refs):  # [M, B, K, S, J] codes as stored: (page, J) blocks
        at = stream_map(row, i, j, *refs)
        return *at[:3], at[4], 0

    # Every head of a page per step: streams as [M, B, K, C, S] (tokens on the lanes; a token-major link's
    # codes as stored), α as stored.
    in_specs, args = [pl.BlockSpec((None, kh, rb, d), row_map)], [q]
    for streams, chain_alphas, links in ((keys, k_alpha, k_links), (values, v_alpha, v_links)):
        for st, ln in zip(streams, links):
            for x in (st.codes, st.scale, st.offset):
                if x.dtype == jnp.float16:  # Mosaic loads no float16 vector: its bits (XLA:TPU may copy them)
                    x = jax.lax.bitcast_convert_type(x, jnp.uint16)
                if x is st.codes and token_major(ln):
                    args.append(x)
                    in_specs.append(pl.BlockSpec((None, None, kh, page, x.shape[-1]), token_major_map))
                    continue
                args.append(jnp.swapaxes(x, -1, -2))
                in_specs.append(pl.BlockSpec((None, None, kh, x.shape[-1], page), stream_map))
        for a in chain_alphas:
            if a is not None:
                args.append(a)
                in_specs.append(pl.BlockSpec((None, None, kh, page), alpha_map))
    means = tuple(mean_scores) if mean_scores is not None else (None,) * len(keys)
    if any(mu is not None for mu in means):  # [B, K, links, R, 1]: head h's link i as an [R, 1] column
        args.append(jnp.stack([jnp.zeros((b, kh, r), jnp.float32) if mu is None else mu.astype(jnp.float32)
                               for mu in means], axis=2)[..., None])
        in_specs.append(pl.BlockSpec((None, kh, len(means), rb, 1), lambda row, i, j, *_: (row, 0, 0, i, 0)))

    kernel = functools.partial(
        _kernel, k_links=k_links, v_links=v_links, k_has_alpha=tuple(a is not None for a in k_alpha),
        v_has_alpha=tuple(a is not None for a in v_alpha), has_mean=tuple(mu is not None for mu in means),
        page=page, sm_scale=1.0 / math.sqrt(d))
    acc, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, pl.cdiv(r, rb), n),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, kh, rb, d), row_map), pl.BlockSpec((None, kh, rb, 1), row_map),
                       pl.BlockSpec((None, kh, rb, 1), row_map)],
            scratch_shapes=[pltpu.VMEM((kh, rb, d), jnp.float32), pltpu.VMEM((kh, rb, 1), jnp.float32),
                            pltpu.VMEM((kh, rb, 1), jnp.float32)] + [pltpu.VMEM((kh, page), jnp.float32)] * len(alphas),
        ),
        out_shape=[jax.ShapeDtypeStruct((b, kh, r, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=limit),
        interpret=interpret,
        name="tpu_residual_decode_attention",
    )(jnp.asarray(slot, jnp.int32).reshape(1), flat_table(table), lengths, *args)
    return acc, m[..., 0], l[..., 0]


# ---- the reference ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=_STATIC)
def tpu_residual_decode_attention_reference(q, keys, values, k_alpha, v_alpha, mean_scores, lengths, slot,
                                            block_table=None, *, k_bits=None, v_bits=None, k_group_sizes=None,
                                            v_group_sizes=None, block_s=None, generation=None, interpret=False):
    """`tpu_residual_decode_attention` in plain jnp: the pool's pages gathered through `block_table` into each
    row's logical order, metadata and α past each row's length zeroed (they may hold anything, NaN included),
    then `residual_attention.residual_decode_attention_reference` (float32, HIGHEST precision); block
    arguments ignored."""
    del block_s, generation, interpret
    keys, values, k_alpha, v_alpha = tuple(keys), tuple(values), tuple(k_alpha), tuple(v_alpha)
    _check(q, keys, values, k_alpha, v_alpha, mean_scores, lengths, block_table)
    b, kh, r, d = q.shape
    lengths, table, _, s = dc.paged_lengths(lengths, block_table, keys[0].codes.shape)
    if s == 0:
        return dc.empty_partial(b, kh, r, d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, S]

    def logical(x, zero):  # the slot's tokens in each row's order: [1, B, K, S, ...]
        x = (x if table is None else dc.rows_of_pages(x, table))[slot]
        if zero:
            x = x.astype(jnp.float32)
            x = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 3)), x, 0.0)
        return x[None]

    def streams(chain):
        return tuple(QuantStream(logical(st.codes, False), logical(st.scale, True), logical(st.offset, True))
                     for st in chain)

    def alphas(chain):
        return tuple(None if a is None else logical(a, True) for a in chain)

    return ra.residual_decode_attention_reference(
        q, streams(keys), streams(values), alphas(k_alpha), alphas(v_alpha), mean_scores, lengths, 0,
        k_bits=k_bits, v_bits=v_bits, k_group_sizes=k_group_sizes, v_group_sizes=v_group_sizes)
