"""Fused decode attention over a packed ResidualQuant cache (Pallas, Triton backend).

The rotated queries of one loop attend to a slot's stored past by reading, tile by tile, the packed
codes of the loop's reference chain (the loop's own residual, then its parent, ..., the anchor),
their group scales/offsets and α, and reconstructing scores and values in registers:

    score_s = ( Σ_i (Π_{j<i} αk_{j,s}) · (q · D(ck_{i,s}) + mean_score_i) ) / sqrt(D)     s < lengths[b]
    acc     = Σ_s exp(score_s − m) · Σ_i (Π_{j<i} αv_{j,s}) · D(cv_{i,s})      (rotated value basis)

D(c) = offset[c // g] + scale[c // g] · code_c per channel. A one-link chain (the anchor loop, or the
`uniform`/`rotated` formats) reads one stream. The output is the unnormalised partial (acc, m, l); the
caller merges the current token and un-rotates once.

Per tile of block_s tokens (the structure keeps registers bounded; `scripts/kernel_report.py` checks
every shipped configuration compiles without spills):

    keys:    either per link and metadata group G (a power of two >= 16 channels, so a valid dot
             operand): q·D(c) over G = scale_G · (q_G · codes_G) + offset_G · Σ_{c∈G} q_c — codes
             exact in bfloat16, the query split into bf16 hi + lo outside the kernel, the group sums
             of the query precomputed outside too; or (`dequant_keys`, the launch table's choice for
             long fine-grained chains, whose per-group dots (links × D/G of them) do not fit the
             registers) the chain's reconstructed keys as one tile, like the values below, and one
             split dot q · ẑ_kᵀ, with the key means as Σ_i (Π_{j<i} αk_j) · mean_score_i.
    values:  the chain's reconstruction as one [block_s, D] tile, ẑ = D(c_0) + α_0 ⊙ (D(c_1) + α_1 ⊙ ...)
             (scales and offsets broadcast over their groups), then one split dot p · ẑ into a single
             [rows, D] accumulator, which the warps share instead of each holding a copy of per-group
             accumulators.

A group (or the whole head dim, for values) may straddle packing planes (planar packing: plane k of a
byte row holds channels [k·J, (k+1)·J); head dim 96 has planes of 24 or 48 channels): then each
channel's byte is gathered from the row and shifted by its own plane. Query rows are padded to >= 16
and head dims to a power of two, masked. FP8 metadata is passed as its bits and decoded with integer
ops (`decode_common.float8_e4m3fn_bits_to_f32`), which Ampere needs.

Layout (fixed by rq_jax; M stacks the slots, `slot` picks one inside the kernel):
    codes  uint8 [M, B, K, S, D·bits/8], planar packing, bits ∈ {2, 4, 8}
    scale, offset [M, B, K, S, D/g]  float8_e4m3fn | bfloat16 | float16 | float32
    alpha  [M, B, K, S] bfloat16 (link i's α scales link i + 1), or None (α = 1)
With a block table [B, N'] every operand is a pool of pages instead, [M, NP, K, P, ...] (the paged cache of
`rq_jax.cache.base`: codes, metadata and α of a page at one pool index), and row b's position s lies at offset
s mod P of page block_table[b, s // P]; the kernel reads each tile's tokens page-indexed
(`decode_common.Tokens`), so a tile may span pages and P need not be a power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode_common as dc
from pallas_kernels import launch

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_META = (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256


class QuantStream(NamedTuple):
    """One chain link's packed codes and group metadata, still stacked over slots."""

    codes: jax.Array   # uint8 [M, B, K, S, D*bits/8]
    scale: jax.Array   # [M, B, K, S, D/g]
    offset: jax.Array  # [M, B, K, S, D/g]


@dataclasses.dataclass(frozen=True)
class Link:
    """Static packing of one link: `bits` per code, `group` channels per scale/offset, `dim` channels,
    `meta`: the dtype name of its scale and offset."""

    bits: int
    group: int
    dim: int
    meta: str

    @property
    def nbytes(self) -> int:  # J: bytes per token = channels per plane
        return self.dim * self.bits // 8

    @property
    def ngroups(self) -> int:
        return self.dim // self.group


def _pieces(links: Sequence[Link], dim: int) -> tuple[tuple[int, int], ...]:
    """(start, width) channel pieces of the key dots: the finest link's groups, which lie inside one group
    of every link (group sizes are powers of two)."""
    width = min(ln.group for ln in links)
    return tuple((start, width) for start in range(0, dim, width))


# ---- validation ----------------------------------------------------------------------------------


def chain_links(streams: Sequence[QuantStream], bits: Sequence[int] | None, groups: Sequence[int] | None,
                dim: int, what: str, supported_bits: tuple[int, ...]) -> tuple[Link, ...]:
    """Static link descriptions of a chain from the arrays' shapes, checked against `bits`/`groups` when
    given: the checks every packed decode kernel shares (its own limits come after). Raises
    NotImplementedError for codes that are not uint8 or of a width outside `supported_bits`, ValueError for
    inconsistent input."""
    if bits is not None and len(bits) != len(streams) or groups is not None and len(groups) != len(streams):
        raise ValueError(f"{what}: {len(streams)} links but bits={bits}, group sizes={groups}")
    out = []
    for i, st in enumerate(streams):
        nbytes, ngroups = st.codes.shape[-1], st.scale.shape[-1]
        b = 8 * nbytes // dim if bits is None else int(bits[i])
        if b not in supported_bits:
            raise NotImplementedError(f"{what} link {i}: {b}-bit codes (kernel covers {supported_bits})")
        if nbytes * 8 != dim * b:
            raise ValueError(f"{what} link {i}: codes last dim {nbytes} != {dim} * {b} / 8")
        if st.codes.dtype != jnp.uint8:
            raise NotImplementedError(f"{what} link {i}: codes dtype {st.codes.dtype} (kernel reads uint8)")
        if ngroups == 0 or dim % ngroups:
            raise NotImplementedError(f"{what} link {i}: {ngroups} metadata groups for head dim {dim}")
        g = dim // ngroups if groups is None else int(groups[i])
        if g * ngroups != dim:
            raise ValueError(f"{what} link {i}: scale last dim {ngroups} != {dim} / {g}")
        if st.offset.shape != st.scale.shape or st.scale.shape[:-1] != st.codes.shape[:-1]:
            raise ValueError(f"{what} link {i}: codes {st.codes.shape}, scale {st.scale.shape}, "
                             f"offset {st.offset.shape} disagree")
        out.append(Link(b, g, dim, jnp.dtype(st.scale.dtype).name))
    return tuple(out)


def _links(streams: Sequence[QuantStream], bits: Sequence[int] | None, groups: Sequence[int] | None,
           dim: int, what: str) -> tuple[Link, ...]:
    """`chain_links`, and what this kernel does not cover: group sizes other than powers of two >= 16,
    metadata dtypes outside SUPPORTED_META."""
    links = chain_links(streams, bits, groups, dim, what, SUPPORTED_BITS)
    for i, (st, ln) in enumerate(zip(streams, links)):
        if ln.group < 16 or ln.group & (ln.group - 1):
            raise NotImplementedError(f"{what} link {i}: group size {ln.group} (kernel covers powers of two >= 16)")
        for arr in (st.scale, st.offset):
            if arr.dtype not in [jnp.dtype(t) for t in SUPPORTED_META]:
                raise NotImplementedError(f"{what} link {i}: metadata dtype {arr.dtype}")
    return links


def check_chain(q, lengths, keys, values, k_alpha, v_alpha, mean_scores, block_table=None) -> None:
    """ValueError for the operands of a packed decode kernel (`residual_decode_attention`'s signature) that
    disagree: q [B, K, R, D], every link [M, B, K, S, ...] (a pool [M, NP, K, P, ...] with `block_table`
    [B, N']), α of the links' leading shape, mean scores [B, K, R] (one entry per link), lengths [B]."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, R, D], got {q.shape}")
    if not keys:
        raise ValueError("the chain needs at least one link")
    if len(values) != len(keys):
        raise ValueError(f"{len(keys)} key links but {len(values)} value links")
    for name, alphas in (("k_alpha", k_alpha), ("v_alpha", v_alpha)):
        if len(alphas) != len(keys) - 1:
            raise ValueError(f"{name}: {len(alphas)} entries for a chain of {len(keys)} links")
    if mean_scores is not None and len(mean_scores) != len(keys):
        raise ValueError(f"mean_scores: {len(mean_scores)} entries for a chain of {len(keys)} links")
    b, k, r, _ = q.shape
    lead = keys[0].codes.shape[:4]
    dc.check_table(block_table, b, lead, k)
    for st in (*keys, *values):
        if st.codes.ndim != 5 or st.codes.shape[:4] != lead:
            raise ValueError(f"every link must be [M, B, K, S, ...] (or a pool [M, NP, K, P, ...]) with leading "
                             f"axes {lead}, got {st.codes.shape}")
    for a in (*k_alpha, *v_alpha):
        if a is not None and a.shape != lead:
            raise ValueError(f"alpha shape {a.shape} != {lead}")
    for mu in mean_scores or ():
        if mu is not None and mu.shape != (b, k, r):
            raise ValueError(f"mean score shape {mu.shape} != {(b, k, r)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [{b}], got {lengths.shape}")


def _check_dtypes(q) -> None:
    """NotImplementedError for queries this kernel does not cover."""
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (kernel covers float32 and bfloat16)")
    if q.shape[-1] % 16 or q.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {q.shape[-1]} (kernel covers multiples of 16 up to {MAX_HEAD_DIM})")


# ---- the kernel ----------------------------------------------------------------------------------


def _zero(ref):
    return jnp.zeros((), ref.dtype)


def _f32(raw: jax.Array) -> jax.Array:
    """Loaded α or metadata as float32; uint8 metadata holds FP8 (e4m3fn) bits."""
    return dc.float8_e4m3fn_bits_to_f32(raw) if raw.dtype == jnp.uint8 else raw.astype(jnp.float32)


def _kernel(*refs, plan: dc.DecodePlan, k_links, v_links, k_pieces, k_has_alpha, v_has_alpha, has_mean,
            q_split: bool, dequant_keys: bool, rows: int, dim: int, page: int):
    it = iter(refs)
    slot_ref, len_ref = next(it), next(it)
    table_ref = next(it) if page else None
    qhi_ref = next(it)
    qlo_ref = next(it) if q_split else None
    qsum_ref = None if dequant_keys else next(it)
    k_refs = [(next(it), next(it), next(it)) for _ in k_links]
    ka_refs = [next(it) if h else None for h in k_has_alpha]
    v_refs = [(next(it), next(it), next(it)) for _ in v_links]
    va_refs = [next(it) if h else None for h in v_has_alpha]
    mean_ref = next(it) if any(has_mean) else None
    acc_ref, m_ref, l_ref = next(it), next(it), next(it)

    slot, length = slot_ref[()], len_ref[()]
    r_blk, split = pl.program_id(2), pl.program_id(3)
    bs, br, dpad = plan.block_s, plan.block_r, dc.next_pow2(dim)
    row_ok = (r_blk * br + jnp.arange(br)) < rows
    ch_ok = jnp.arange(dpad) < dim

    def rows_load(ref, col):  # [br, width] at a column slice, or [br] at one column (padded rows read 0)
        mask = row_ok[:, None] if isinstance(col, pl.Slice) else row_ok
        return dc.load(ref.at[:, col], mask=mask, other=_zero(ref))

    def q_load(ref, start, width):  # [br, width] query channels, 0 in padded rows and past the head dim
        ok = row_ok[:, None] & (start + jnp.arange(width) < dim)[None, :]
        return dc.load(ref.at[:, pl.ds(start, width)], mask=ok, other=_zero(ref))

    q_pieces = [(q_load(qhi_ref, a, w), q_load(qlo_ref, a, w) if q_split else None)
                for a, w in (((0, dpad),) if dequant_keys else k_pieces)]
    q_sums = [] if dequant_keys else [[rows_load(qsum_ref, jnp.int32(i * MAX_GROUPS + g))
                                       for g in range(ln.ngroups)] for i, ln in enumerate(k_links)]
    means = [rows_load(mean_ref, jnp.int32(i)).astype(jnp.float32) if h else None for i, h in enumerate(has_mean)]
    sm_scale = 1.0 / math.sqrt(dim)

    def body(t, carry):
        m_prev, l_prev, acc = carry
        t0 = t * bs
        tok_ok = (split * plan.split_len + t0 + jnp.arange(bs)) < length
        tok = dc.Tokens.of_tile(slot, t0, split, tok_ok, plan, table_ref, page)

        def vec(ref, *idx):  # a per-token vector [bs] as float32 (α, or one group's metadata)
            return _f32(dc.load(ref.at[tok.at(*idx)], mask=tok_ok, other=_zero(ref)))

        def codes(c_ref, link: Link, start: int, width: int):
            """Codes of channels [start, start + width) [bs, width] as float32 (exact; 0 past the head dim)."""
            plane, last = start // link.nbytes, (start + width - 1) // link.nbytes
            if plane == last:  # one plane: a slice of the byte row, one shift
                raw = dc.load(c_ref.at[tok.at(pl.ds(start - plane * link.nbytes, width))],
                              mask=tok_ok[:, None], other=_zero(c_ref))
                shift = jnp.uint8(plane * link.bits)
            else:  # across planes: gather each channel's byte, shift by its own plane
                ch = start + jnp.arange(width)
                raw = dc.load(c_ref.at[tok.gather(ch % link.nbytes)],
                              mask=tok_ok[:, None] & (ch < dim)[None, :], other=_zero(c_ref))
                shift = ((ch // link.nbytes) * link.bits).astype(jnp.uint8)[None, :]
            if link.bits < 8:
                raw = (raw >> shift) & ((1 << link.bits) - 1)
            return raw.astype(jnp.float32)

        def dequantized(refs, link: Link):  # D(c) [bs, dpad] float32 (0 past the head dim)
            c_ref, s_ref, o_ref = refs
            n = dpad // link.group
            mask = tok_ok[:, None] & (jnp.arange(n) < link.ngroups)[None, :]

            def per_channel(ref):  # [bs, n] group metadata, each repeated over its group's channels
                x = _f32(dc.load(ref.at[tok.at(pl.ds(0, n))], mask=mask, other=_zero(ref)))
                return jnp.broadcast_to(x[:, :, None], (bs, n, link.group)).reshape(bs, dpad)
            return per_channel(o_ref) + per_channel(s_ref) * codes(c_ref, link, 0, dpad)

        def chain(refs, links, alpha_refs):  # ẑ_0 [bs, dpad]: ẑ_i = D(c_i) + α_i ⊙ ẑ_{i+1}, from the anchor up
            z = dequantized(refs[-1], links[-1])
            for i in reversed(range(len(links) - 1)):
                z = dequantized(refs[i], links[i]) + (z if alpha_refs[i] is None else vec(alpha_refs[i])[:, None] * z)
            return z

        def alpha_products():  # Π_{j<i} αk_j [bs] per key link (None: 1)
            out, coef = [], None
            for i in range(len(k_links)):
                out.append(coef)
                if i + 1 < len(k_links) and ka_refs[i] is not None:
                    a = vec(ka_refs[i])
                    coef = a if coef is None else coef * a
            return out

        def weighted(terms):  # Σ_i (Π_{j<i} αk_j) ⊙ term_i over the links' [br, bs] terms (None: absent)
            out = None
            for term, coef in zip(terms, alpha_products()):
                if term is not None:
                    term = term if coef is None else coef[None, :] * term
                    out = term if out is None else out + term
            return out

        def group_scores(i, link, refs):  # q · D(c_i) [br, bs], group by group from the codes
            c_ref, s_ref, o_ref = refs
            part = None
            for g in range(link.ngroups):
                dots = None
                for j, (a, w) in enumerate(k_pieces):
                    if a // link.group == g:
                        d = dc.dot_split(q_pieces[j], dc.split_bf16(codes(c_ref, link, a, w), exact=True),
                                         trans_b=True)
                        dots = d if dots is None else dots + d
                gi = jnp.int32(g)
                term = dots * vec(s_ref, gi)[None, :] + q_sums[i][g][:, None] * vec(o_ref, gi)[None, :]
                part = term if part is None else part + term
            return part

        mean_terms = [None if mu is None else mu[:, None] for mu in means]
        if dequant_keys:
            score = dc.dot_split(q_pieces[0], dc.split_bf16(chain(k_refs, k_links, ka_refs)), trans_b=True)
            if any(mu is not None for mu in means):
                score = score + weighted(mean_terms)
        else:
            score = weighted([group_scores(i, ln, refs) + (0.0 if mu is None else mu)
                              for i, (ln, refs, mu) in enumerate(zip(k_links, k_refs, mean_terms))])
        score = jnp.where(tok_ok[None, :], score * sm_scale, -jnp.inf)
        p, m_new, l_new, corr = dc.online_softmax(score, m_prev, l_prev)

        z = chain(v_refs, v_links, va_refs)
        acc = corr[:, None] * acc + dc.dot_split(dc.split_bf16(p), dc.split_bf16(z))
        return m_new, l_new, acc

    init = (jnp.full((br,), dc.NEG, jnp.float32), jnp.zeros((br,), jnp.float32), jnp.zeros((br, dpad), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, dc.num_tiles(length, split, plan), body, init)
    m_ref[...] = m
    l_ref[...] = l
    if dim == dpad:
        acc_ref[...] = acc
    else:
        dc.store(acc_ref, acc, mask=ch_ok[None, :])


# ---- the public function ------------------------------------------------------------------------

_STATIC = ("k_bits", "v_bits", "k_group_sizes", "v_group_sizes", "block_s", "num_splits", "block_r",
           "num_warps", "num_stages", "dequant_keys", "interpret")
#: Query-sum columns per key link: the most metadata groups a head dim can have (256 / 16).
MAX_GROUPS = MAX_HEAD_DIM // 16


@functools.partial(jax.jit, static_argnames=_STATIC)
def residual_decode_attention(
    q: jax.Array,                             # [B, K, R, D] float32 | bfloat16, rotated key basis
    keys: Sequence[QuantStream],              # chain links, the loop first and the anchor last
    values: Sequence[QuantStream],            # the same chain for values
    k_alpha: Sequence[jax.Array | None],      # len(keys) - 1 entries: [M, B, K, S] bf16, or None (α = 1)
    v_alpha: Sequence[jax.Array | None],      # len(values) - 1 entries
    mean_scores: Sequence[jax.Array | None] | None,  # per key link: q·μ_i [B, K, R] float32, or None
    lengths: jax.Array,                       # [B] int32 valid stored tokens per row
    slot: jax.Array | int,                    # [] int32: which of the M stacked slots
    block_table: jax.Array | None = None,     # [B, N'] int32 pool page of each row's logical page; None: contiguous
    *,
    k_bits: tuple[int, ...] | None = None,    # per key link; None: read from the shapes
    v_bits: tuple[int, ...] | None = None,
    k_group_sizes: tuple[int, ...] | None = None,
    v_group_sizes: tuple[int, ...] | None = None,
    block_s: int | None = None,
    num_splits: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dequant_keys: bool | None = None,         # keys as one reconstructed tile; None: the launch table's
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial of rotated queries over a slot's packed stored tokens (read through
    `block_table` from a pool of pages when given; entries past a row's length are never read).

    Returns acc [B, K, R, D] float32 (rotated value basis, not divided by l), m [B, K, R] float32 and
    l [B, K, R] float32; a row with no valid token gives m = -1e30, l = 0, acc = 0. Raises
    NotImplementedError (at trace time) for configurations the kernel does not cover. Launch
    parameters left unset come from `pallas_kernels.launch` (the split count from `plan_decode`).
    """
    keys, values, k_alpha, v_alpha = tuple(keys), tuple(values), tuple(k_alpha), tuple(v_alpha)
    check_chain(q, lengths, keys, values, k_alpha, v_alpha, mean_scores, block_table)
    _check_dtypes(q)
    b, k, r, d = q.shape
    m_slots, n_pages = keys[0].codes.shape[:2]
    lengths, table, page, s = dc.paged_lengths(lengths, block_table, keys[0].codes.shape[:4])
    k_links = _links(keys, k_bits, k_group_sizes, d, "keys")
    v_links = _links(values, v_bits, v_group_sizes, d, "values")
    k_pieces = _pieces(k_links, d)
    if s == 0:
        return dc.empty_partial(b, k, r, d)
    lp = launch.lookup("residual", d, r, tuple(min(kl.group, vl.group) for kl, vl in zip(k_links, v_links)),
                       paged=bool(page))
    plan = dc.plan_decode(b, k, r, s, block_s=block_s or dc.tile_block(lp.block_s, page), num_splits=num_splits,
                          block_r=block_r, num_warps=num_warps or lp.num_warps, num_stages=num_stages or lp.num_stages,
                          max_block_r=lp.max_block_r)
    dequant_keys = lp.dequant_keys if dequant_keys is None else bool(dequant_keys)
    dpad, br, sl = dc.next_pow2(d), plan.block_r, plan.split_len
    n_rb = pl.cdiv(r, br)
    means = tuple(mean_scores) if mean_scores is not None else (None,) * len(keys)
    slot = jnp.asarray(slot, jnp.int32).reshape(())
    # Outside the kernel, once per call: the query's bfloat16 halves and, for the grouped key path, per key
    # link the sums of its float32 channels over each metadata group (the offset terms; MAX_GROUPS columns
    # per link); FP8 metadata travels as its bits (uint8).
    q32 = q.astype(jnp.float32)
    q_hi = q32.astype(jnp.bfloat16)
    q_split = q.dtype != jnp.bfloat16

    def bits_of(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype == jnp.float8_e4m3fn else x

    def rows_spec(n):
        return pl.BlockSpec((None, None, br, n), lambda b, k, r, j: (b, k, r, 0))

    def token_spec(*width):  # a link's stream (or α) over the program's tokens: its split, or the whole pool
        rest = (0,) * len(width)
        if page:
            return pl.BlockSpec((m_slots, n_pages, None, page, *width), lambda b, k, r, j: (0, 0, k, 0, *rest))
        return pl.BlockSpec((m_slots, None, None, sl, *width), lambda b, k, r, j: (0, b, k, j, *rest))

    def stream_specs(link: Link):
        meta = token_spec(max(dpad // link.group, dc.next_pow2(link.ngroups)))
        return [token_spec(dc.next_pow2(link.nbytes)), meta, meta]

    alpha_spec = token_spec()
    in_specs = [dc.scalar_spec(), pl.BlockSpec((None,), lambda b, k, r, j: (b,))]
    args = [slot, lengths]
    if page:
        in_specs.append(pl.BlockSpec((None, table.shape[1]), lambda b, k, r, j: (b, 0)))
        args.append(table)
    in_specs.append(rows_spec(dpad))
    args.append(q_hi)
    if q_split:
        in_specs.append(rows_spec(dpad))
        args.append((q32 - q_hi.astype(jnp.float32)).astype(jnp.bfloat16))
    if not dequant_keys:
        q_sums = jnp.concatenate([jnp.pad(q32.reshape(b, k, r, ln.ngroups, ln.group).sum(-1),
                                          ((0, 0),) * 3 + ((0, MAX_GROUPS - ln.ngroups),)) for ln in k_links], -1)
        in_specs.append(rows_spec(dc.next_pow2(q_sums.shape[-1])))
        args.append(q_sums)
    for links, streams, alphas in ((k_links, keys, k_alpha), (v_links, values, v_alpha)):
        for link, st in zip(links, streams):
            in_specs += stream_specs(link)
            args += [st.codes, bits_of(st.scale), bits_of(st.offset)]
        for a in alphas:
            if a is not None:
                in_specs.append(alpha_spec)
                args.append(a)
    if any(mu is not None for mu in means):
        stacked = jnp.stack([jnp.zeros((b, k, r), jnp.float32) if mu is None else mu.astype(jnp.float32)
                             for mu in means], axis=-1)
        in_specs.append(rows_spec(dc.next_pow2(len(means))))
        args.append(stacked)

    kernel = functools.partial(
        _kernel, plan=plan, k_links=k_links, v_links=v_links, k_pieces=k_pieces,
        k_has_alpha=tuple(a is not None for a in k_alpha), v_has_alpha=tuple(a is not None for a in v_alpha),
        has_mean=tuple(mu is not None for mu in means), q_split=q_split, dequant_keys=dequant_keys, rows=r, dim=d,
        page=page)
    rtot, ns = n_rb * br, plan.num_splits
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, k, n_rb, ns),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, br, dpad), lambda b, k, r, j: (b, k, j, r, 0)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r))],
        out_shape=[jax.ShapeDtypeStruct((b, k, ns, rtot, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, k, ns, rtot), jnp.float32),
                   jax.ShapeDtypeStruct((b, k, ns, rtot), jnp.float32)],
        compiler_params=dc.compiler_params(plan.num_warps, plan.num_stages),
        interpret=interpret,
        name="residual_decode_attention",
    )(*args)
    acc, m, l = dc.combine_splits(acc, m, l)
    return acc[:, :, :r], m[:, :, :r], l[:, :, :r]


# ---- the reference ------------------------------------------------------------------------------


def unpack_planar(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 [..., D·bits/8] planar-packed codes -> uint8 [..., D] (plane k = channels [kJ, (k+1)J))."""
    if bits == 8:
        return codes
    mask = (1 << bits) - 1
    return jnp.concatenate([(codes >> (k * bits)) & mask for k in range(8 // bits)], axis=-1)


def dequantize(stream: QuantStream, bits: int, slot) -> jax.Array:
    """float32 [B, K, S, D]: offset + scale · code per channel group, of one slot."""
    codes = unpack_planar(stream.codes[slot], bits).astype(jnp.float32)
    g = codes.shape[-1] // stream.scale.shape[-1]
    scale = jnp.repeat(stream.scale[slot].astype(jnp.float32), g, axis=-1)
    offset = jnp.repeat(stream.offset[slot].astype(jnp.float32), g, axis=-1)
    return offset + scale * codes


@functools.partial(jax.jit, static_argnames=_STATIC)
def residual_decode_attention_reference(
    q, keys, values, k_alpha, v_alpha, mean_scores, lengths, slot, block_table=None, *, k_bits=None, v_bits=None,
    k_group_sizes=None, v_group_sizes=None, block_s=None, num_splits=None, block_r=None, num_warps=None,
    num_stages=None, dequant_keys=None, interpret=False,
):
    """`residual_decode_attention` in plain jnp (float32, HIGHEST precision; a pool read as contiguous rows
    first); launch arguments ignored."""
    del block_s, num_splits, block_r, num_warps, num_stages, dequant_keys, interpret
    keys, values = tuple(keys), tuple(values)
    if block_table is not None:
        keys, values, k_alpha, v_alpha = jax.tree.map(lambda x: dc.rows_of_pages(x, block_table),
                                                      (keys, values, tuple(k_alpha), tuple(v_alpha)))
    b, k, r, d = q.shape
    k_bits = k_bits or tuple(8 * st.codes.shape[-1] // d for st in keys)
    v_bits = v_bits or tuple(8 * st.codes.shape[-1] // d for st in values)
    s = keys[0].codes.shape[3]
    if s == 0:
        return dc.empty_partial(b, k, r, d)
    q = q.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    score, coef = 0.0, 1.0
    for i, st in enumerate(keys):
        part = jnp.einsum("bkrd,bksd->bkrs", q, dequantize(st, k_bits[i], slot), precision=hi)
        if mean_scores is not None and mean_scores[i] is not None:
            part = part + mean_scores[i].astype(jnp.float32)[..., None]
        score = score + coef * part
        if i + 1 < len(keys) and k_alpha[i] is not None:
            coef = coef * k_alpha[i][slot].astype(jnp.float32)[:, :, None, :]
    p, m, l = dc.masked_partial(score / math.sqrt(d), lengths)
    acc = 0.0
    for i, st in enumerate(values):
        acc = acc + jnp.einsum("bkrs,bksd->bkrd", p, dequantize(st, v_bits[i], slot), precision=hi)
        if i + 1 < len(values) and v_alpha[i] is not None:
            p = p * v_alpha[i][slot].astype(jnp.float32)[:, :, None, :]
    return acc, m, l
