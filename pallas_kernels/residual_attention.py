"""Fused decode attention over a packed ResidualQuant cache (Pallas, Triton backend).

The rotated queries of one loop attend to a slot's stored past by reading, tile by tile, the packed
codes of the loop's reference chain (the loop's own residual, then its parent, ..., the anchor),
their group scales/offsets and α, and reconstructing scores and values in registers:

    score_s = ( Σ_i (Π_{j<i} αk_{j,s}) · (q · D(ck_{i,s}) + mean_score_i) ) / sqrt(D)     s < lengths[b]
    acc     = Σ_s exp(score_s − m) · Σ_i (Π_{j<i} αv_{j,s}) · D(cv_{i,s})      (rotated value basis)

D(c) = offset[c // g] + scale[c // g] · code_c per channel. A one-link chain (the anchor loop, or the
`uniform`/`rotated` formats) reads one stream. The output is the unnormalised partial (acc, m, l); the
caller merges the current token and un-rotates once.

Inside the kernel nothing is dequantized into a [tile, D] array. The channels are cut into *pieces*,
the coarsest partition that lies inside one packing plane and one metadata group of every link (planar
packing: plane k of a byte row holds channels [k·J, (k+1)·J)); a piece's codes are one shift-and-mask of
a ref slice of the packed bytes. Per link and group G (following paged_attention's int8 path):

    keys:    q·D(c) over G  = scale_G · Σ_pieces (q_piece · codes_piece) + offset_G · Σ_{c∈G} q_c
    values:  Σ_s w_s D(c_s) = Σ_s (w_s scale_{s,G}) codes_s  +  Σ_s w_s offset_{s,G}      (per piece)

so every dot is codes (exact in bfloat16) against float32 operands split into two bfloat16 halves.
Pieces narrower than 16 channels (head dim 96: planes of 24 channels straddle 16- and 32-channel
groups) are loaded 16 wide with masks, as are query rows (padded to >= 16) and head dims padded to a
power of two.

Layout (fixed by rq_jax; M stacks the slots, `slot` picks one inside the kernel):
    codes  uint8 [M, B, K, S, D·bits/8], planar packing, bits ∈ {2, 4, 8}
    scale, offset [M, B, K, S, D/g]  float8_e4m3fn | bfloat16 | float16 | float32
    alpha  [M, B, K, S] bfloat16 (link i's α scales link i + 1), or None (α = 1)
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

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_META = (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256


class QuantStream(NamedTuple):
    """One chain link's packed codes and group metadata, still stacked over slots."""

    codes: jax.Array   # uint8 [M, B, K, S, D*bits/8]
    scale: jax.Array   # [M, B, K, S, D/g]
    offset: jax.Array  # [M, B, K, S, D/g]


@dataclasses.dataclass(frozen=True)
class _Link:
    """Static packing of one link: `bits` per code, `group` channels per scale/offset, `dim` channels."""

    bits: int
    group: int
    dim: int

    @property
    def nbytes(self) -> int:  # J: bytes per token = channels per plane
        return self.dim * self.bits // 8

    @property
    def ngroups(self) -> int:
        return self.dim // self.group


class _Piece(NamedTuple):
    """Channels [start, start + width) loaded `pad` wide (a power of two >= 16), masked past width."""

    start: int
    width: int
    pad: int


def _pieces(links: Sequence[_Link], dim: int) -> tuple[_Piece, ...]:
    """The coarsest channel partition inside one plane and one group of every link."""
    cuts = {0, dim}
    for ln in links:
        cuts |= set(range(0, dim, ln.nbytes)) | set(range(0, dim, ln.group))
    cuts = sorted(cuts)
    return tuple(_Piece(a, b - a, max(16, dc.next_pow2(b - a))) for a, b in zip(cuts, cuts[1:]))


def _where(link: _Link, piece: _Piece) -> tuple[int, int, int]:
    """(plane, first byte, group) of a piece in a link."""
    plane = piece.start // link.nbytes
    return plane, piece.start - plane * link.nbytes, piece.start // link.group


# ---- validation ----------------------------------------------------------------------------------


def _links(streams: Sequence[QuantStream], bits: Sequence[int] | None, groups: Sequence[int] | None,
           dim: int, what: str) -> tuple[_Link, ...]:
    """Static link descriptions from the arrays' shapes, checked against `bits`/`groups` when given.
    Raises NotImplementedError for what the kernel does not cover, ValueError for inconsistent input."""
    if not streams:
        raise ValueError(f"{what}: the chain needs at least one link")
    if bits is not None and len(bits) != len(streams) or groups is not None and len(groups) != len(streams):
        raise ValueError(f"{what}: {len(streams)} links but bits={bits}, group sizes={groups}")
    out = []
    for i, st in enumerate(streams):
        nbytes, ngroups = st.codes.shape[-1], st.scale.shape[-1]
        b = 8 * nbytes // dim if bits is None else int(bits[i])
        if b not in SUPPORTED_BITS:
            raise NotImplementedError(f"{what} link {i}: {b}-bit codes (kernel covers {SUPPORTED_BITS})")
        if nbytes * 8 != dim * b:
            raise ValueError(f"{what} link {i}: codes last dim {nbytes} != {dim} * {b} / 8")
        if st.codes.dtype != jnp.uint8:
            raise NotImplementedError(f"{what} link {i}: codes dtype {st.codes.dtype} (kernel reads uint8)")
        if ngroups == 0 or dim % ngroups:
            raise NotImplementedError(f"{what} link {i}: {ngroups} metadata groups for head dim {dim}")
        g = dim // ngroups if groups is None else int(groups[i])
        if g * ngroups != dim:
            raise ValueError(f"{what} link {i}: scale last dim {ngroups} != {dim} / {g}")
        if g % 16:
            raise NotImplementedError(f"{what} link {i}: group size {g} (kernel covers multiples of 16)")
        for arr in (st.scale, st.offset):
            if arr.dtype not in [jnp.dtype(t) for t in SUPPORTED_META]:
                raise NotImplementedError(f"{what} link {i}: metadata dtype {arr.dtype}")
        if st.offset.shape != st.scale.shape or st.scale.shape[:-1] != st.codes.shape[:-1]:
            raise ValueError(f"{what} link {i}: codes {st.codes.shape}, scale {st.scale.shape}, "
                             f"offset {st.offset.shape} disagree")
        out.append(_Link(b, g, dim))
    return tuple(out)


def _check_pieces(links: Sequence[_Link], pieces: Sequence[_Piece], dim: int, what: str):
    dpad = dc.next_pow2(dim)
    for p in pieces:
        if p.start + p.pad > dpad:
            raise NotImplementedError(f"{what}: channel piece {p} runs past the padded head dim {dpad}")
        for ln in links:
            _, first, _ = _where(ln, p)
            if first + p.pad > dc.next_pow2(ln.nbytes):
                raise NotImplementedError(f"{what}: piece {p} runs past the padded {ln.bits}-bit byte row")


def _check_common(q, lengths, keys, k_alpha, v_alpha, values, mean_scores):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, R, D], got {q.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (kernel covers float32 and bfloat16)")
    b, k, r, d = q.shape
    if d % 16 or d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} (kernel covers multiples of 16 up to {MAX_HEAD_DIM})")
    if len(values) != len(keys):
        raise ValueError(f"{len(keys)} key links but {len(values)} value links")
    for name, alphas in (("k_alpha", k_alpha), ("v_alpha", v_alpha)):
        if len(alphas) != len(keys) - 1:
            raise ValueError(f"{name}: {len(alphas)} entries for a chain of {len(keys)} links")
    if mean_scores is not None and len(mean_scores) != len(keys):
        raise ValueError(f"mean_scores: {len(mean_scores)} entries for a chain of {len(keys)} links")
    lead = keys[0].codes.shape[:4]
    if lead[1:3] != (b, k):
        raise ValueError(f"cache batch/heads {lead[1:3]} != queries' {(b, k)}")
    for st in (*keys, *values):
        if st.codes.shape[:4] != lead:
            raise ValueError(f"every link must share [M, B, K, S] = {lead}, got {st.codes.shape[:4]}")
    for a in (*k_alpha, *v_alpha):
        if a is not None and a.shape != lead:
            raise ValueError(f"alpha shape {a.shape} != {lead}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [{b}], got {lengths.shape}")


# ---- the kernel ----------------------------------------------------------------------------------


def _zero(ref):
    return jnp.zeros((), ref.dtype)


def _kernel(*refs, plan: dc.DecodePlan, k_links, v_links, k_pieces, v_pieces, k_has_alpha, v_has_alpha,
            has_mean, rows: int, dim: int):
    it = iter(refs)
    slot_ref, len_ref, q_ref = next(it), next(it), next(it)
    k_refs = [(next(it), next(it), next(it)) for _ in k_links]
    ka_refs = [next(it) if h else None for h in k_has_alpha]
    v_refs = [(next(it), next(it), next(it)) for _ in v_links]
    va_refs = [next(it) if h else None for h in v_has_alpha]
    mean_refs = [next(it) if h else None for h in has_mean]
    acc_ref, m_ref, l_ref = next(it), next(it), next(it)

    slot, length = slot_ref[()], len_ref[()]
    r_blk, split = pl.program_id(2), pl.program_id(3)
    bs, br = plan.block_s, plan.block_r
    row_ok = (r_blk * br + jnp.arange(br)) < rows

    def q_piece(p: _Piece):
        mask = row_ok[:, None] & (jnp.arange(p.pad) < p.width)[None, :]
        return dc.load(q_ref.at[:, pl.ds(p.start, p.pad)], mask=mask, other=_zero(q_ref))

    # Per key piece: the query split into bf16 halves for the code dots, and its row sums per channel
    # (summed per group below) for the offset terms.
    q_raw = [q_piece(p) for p in k_pieces]
    q_halves = [dc.split_bf16(x) for x in q_raw]
    q_sums = [jnp.sum(x.astype(jnp.float32), axis=1) for x in q_raw]
    k_groups = [_groups(ln, k_pieces) for ln in k_links]
    q_group_sums = [{g: sum(q_sums[i] for i in idx) for g, idx in groups.items()} for groups in k_groups]
    v_groups = [_groups(ln, v_pieces) for ln in v_links]
    means = [None if ref is None else dc.load(ref, mask=row_ok, other=_zero(ref)).astype(jnp.float32)
             for ref in mean_refs]
    sm_scale = 1.0 / math.sqrt(dim)

    def body(t, carry):
        m_prev, l_prev, acc = carry
        t0 = t * bs
        tok_ok = (split * plan.split_len + t0 + jnp.arange(bs)) < length
        tile = pl.ds(t0, bs)

        def vec(ref, *idx):  # a per-token vector [bs] as float32 (masked tokens read 0)
            return dc.load(ref.at[(slot, tile, *idx)], mask=tok_ok, other=_zero(ref)).astype(jnp.float32)

        def codes(ref, link: _Link, p: _Piece):  # a piece's codes [bs, pad] as bfloat16 (exact)
            plane, first, _ = _where(link, p)
            mask = tok_ok[:, None]
            if p.width < p.pad:
                mask = mask & (jnp.arange(p.pad) < p.width)[None, :]
            raw = dc.load(ref.at[slot, tile, pl.ds(first, p.pad)], mask=mask, other=_zero(ref))
            if link.bits < 8:
                raw = (raw >> (plane * link.bits)) & ((1 << link.bits) - 1)
            return raw.astype(jnp.bfloat16)

        score, coef = None, None
        for i, (link, (c_ref, s_ref, o_ref)) in enumerate(zip(k_links, k_refs)):
            part = None
            for g, idx in k_groups[i].items():
                dots = None
                for j in idx:
                    d = dc.dot_split(q_halves[j], codes(c_ref, link, k_pieces[j]), trans_b=True)
                    dots = d if dots is None else dots + d
                gi = jnp.int32(g)
                term = dots * vec(s_ref, gi)[None, :] + q_group_sums[i][g][:, None] * vec(o_ref, gi)[None, :]
                part = term if part is None else part + term
            if means[i] is not None:
                part = part + means[i][:, None]
            score = part if score is None else score + (part if coef is None else coef[None, :] * part)
            if i + 1 < len(k_links) and ka_refs[i] is not None:
                a = vec(ka_refs[i])
                coef = a if coef is None else coef * a
        score = jnp.where(tok_ok[None, :], score * sm_scale, -jnp.inf)
        p, m_new, l_new, corr = dc.online_softmax(score, m_prev, l_prev)

        acc = [corr[:, None] * a for a in acc]
        w = p
        for i, (link, (c_ref, s_ref, o_ref)) in enumerate(zip(v_links, v_refs)):
            for g, idx in v_groups[i].items():
                gi = jnp.int32(g)
                scaled = dc.split_bf16(w * vec(s_ref, gi)[None, :])
                shift = jnp.sum(w * vec(o_ref, gi)[None, :], axis=1)[:, None]
                for j in idx:
                    acc[j] = acc[j] + dc.dot_split(scaled, codes(c_ref, link, v_pieces[j])) + shift
            if i + 1 < len(v_links) and va_refs[i] is not None:
                w = w * vec(va_refs[i])[None, :]
        return m_new, l_new, acc

    init = (jnp.full((br,), dc.NEG, jnp.float32), jnp.zeros((br,), jnp.float32),
            [jnp.zeros((br, p.pad), jnp.float32) for p in v_pieces])
    m, l, acc = jax.lax.fori_loop(0, dc.num_tiles(length, split, plan), body, init)
    m_ref[...] = m
    l_ref[...] = l
    for p, a in zip(v_pieces, acc):
        if p.width == p.pad:
            acc_ref[:, pl.ds(p.start, p.pad)] = a
        else:
            dc.store(acc_ref.at[:, pl.ds(p.start, p.pad)], a, mask=(jnp.arange(p.pad) < p.width)[None, :])


def _groups(link: _Link, pieces: Sequence[_Piece]) -> dict[int, list[int]]:
    """Metadata group -> indices of the pieces inside it, for one link."""
    out: dict[int, list[int]] = {}
    for j, p in enumerate(pieces):
        out.setdefault(_where(link, p)[2], []).append(j)
    return out


# ---- the public function ------------------------------------------------------------------------

_STATIC = ("k_bits", "v_bits", "k_group_sizes", "v_group_sizes", "block_s", "num_splits", "block_r",
           "num_warps", "num_stages", "interpret")


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
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial of rotated queries over a slot's packed stored tokens.

    Returns acc [B, K, R, D] float32 (rotated value basis, not divided by l), m [B, K, R] float32 and
    l [B, K, R] float32; a row with no valid token gives m = -1e30, l = 0, acc = 0. Raises
    NotImplementedError (at trace time) for configurations the kernel does not cover. Block sizes
    default to `decode_common.default_block_s` / `plan_decode`.
    """
    keys, values, k_alpha, v_alpha = tuple(keys), tuple(values), tuple(k_alpha), tuple(v_alpha)
    _check_common(q, lengths, keys, k_alpha, v_alpha, values, mean_scores)
    b, k, r, d = q.shape
    m_slots, s = keys[0].codes.shape[0], keys[0].codes.shape[3]
    k_links = _links(keys, k_bits, k_group_sizes, d, "keys")
    v_links = _links(values, v_bits, v_group_sizes, d, "values")
    k_pieces, v_pieces = _pieces(k_links, d), _pieces(v_links, d)
    _check_pieces(k_links, k_pieces, d, "keys")
    _check_pieces(v_links, v_pieces, d, "values")
    if s == 0:
        return dc.empty_partial(b, k, r, d)
    plan = dc.plan_decode(b, k, r, s, block_s=block_s or dc.default_block_s(len(keys), d),
                          num_splits=num_splits, block_r=block_r, num_warps=num_warps, num_stages=num_stages)
    dpad, br, sl = dc.next_pow2(d), plan.block_r, plan.split_len
    n_rb = pl.cdiv(r, br)
    means = tuple(mean_scores) if mean_scores is not None else (None,) * len(keys)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    slot = jnp.asarray(slot, jnp.int32).reshape(())

    def stream_specs(link: _Link):
        codes = pl.BlockSpec((m_slots, None, None, sl, dc.next_pow2(link.nbytes)), lambda b, k, r, j: (0, b, k, j, 0))
        meta = pl.BlockSpec((m_slots, None, None, sl, dc.next_pow2(link.ngroups)), lambda b, k, r, j: (0, b, k, j, 0))
        return [codes, meta, meta]

    alpha_spec = pl.BlockSpec((m_slots, None, None, sl), lambda b, k, r, j: (0, b, k, j))
    in_specs = [dc.scalar_spec(), pl.BlockSpec((None,), lambda b, k, r, j: (b,)),
                pl.BlockSpec((None, None, br, dpad), lambda b, k, r, j: (b, k, r, 0))]
    args = [slot, lengths, q]
    for links, streams, alphas in ((k_links, keys, k_alpha), (v_links, values, v_alpha)):
        for link, st in zip(links, streams):
            in_specs += stream_specs(link)
            args += [st.codes, st.scale, st.offset]
        for a in alphas:
            if a is not None:
                in_specs.append(alpha_spec)
                args.append(a)
    for mean in means:
        if mean is not None:
            in_specs.append(pl.BlockSpec((None, None, br), lambda b, k, r, j: (b, k, r)))
            args.append(mean.astype(jnp.float32))

    kernel = functools.partial(
        _kernel, plan=plan, k_links=k_links, v_links=v_links, k_pieces=k_pieces, v_pieces=v_pieces,
        k_has_alpha=tuple(a is not None for a in k_alpha), v_has_alpha=tuple(a is not None for a in v_alpha),
        has_mean=tuple(mu is not None for mu in means), rows=r, dim=d)
    rtot, ns = n_rb * br, plan.num_splits
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, k, n_rb, ns),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, br, dpad), lambda b, k, r, j: (b, k, j, r, 0)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r)),
                   pl.BlockSpec((None, None, None, br), lambda b, k, r, j: (b, k, j, r))],
        out_shape=[jax.ShapeDtypeStruct((b, k, ns, rtot, dpad), jnp.float32),
                   jax.ShapeDtypeStruct((b, k, ns, rtot), jnp.float32),
                   jax.ShapeDtypeStruct((b, k, ns, rtot), jnp.float32)],
        compiler_params=dc.compiler_params(plan.num_warps, plan.num_stages),
        interpret=interpret,
        name="residual_decode_attention",
    )(*args)
    acc, m, l = dc.combine_splits(acc, m, l)
    return acc[:, :, :r, :d], m[:, :, :r], l[:, :, :r]


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
    q, keys, values, k_alpha, v_alpha, mean_scores, lengths, slot, *, k_bits=None, v_bits=None,
    k_group_sizes=None, v_group_sizes=None, block_s=None, num_splits=None, block_r=None, num_warps=None,
    num_stages=None, interpret=False,
):
    """`residual_decode_attention` in plain jnp (float32, HIGHEST precision); block arguments ignored."""
    del block_s, num_splits, block_r, num_warps, num_stages, interpret
    keys, values = tuple(keys), tuple(values)
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
