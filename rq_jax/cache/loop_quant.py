"""Loop-group quantized KV: ResidualQuant (`residual`) and its baselines `uniform` and `rotated`.

The loops of a slot's layer are split into consecutive groups of `len(bits)` loops (Ouro's 4 loops:
one group; Huginn's 32 steps: 8 groups of 4, each anchored on its own last step). A final partial
group of m < len(bits) loops uses the last m entries of `bits` with residuals (so its anchor keeps the
anchor width) and the first m without. Per group, in the rotated basis z = U x (U per group, layer and
kv head; keys and values separately):

    residual=True:   anchor quantized first; every other loop r stores Q(z_r − α_r·ẑ_p(r) − μ_r) and
                     α_r = <z_r, ẑ_p> / |ẑ_p|² (bf16), against the *reconstructed* reference (toolbox
                     `rq_jax.quant.residual`); key means μ only for keys.
    residual=False:  every loop quantized on its own with bits[position] (the paper's "Direct").

A residual loop may store 0 bits: no codes and no metadata, only its α, so it reads its reference
scaled — the "0-bit residual" that loop sharing (`rq_jax.cache.share`) is for a whole group.

`uniform` = residual off, identity rotation; `rotated` = residual off, Hadamard (or random, or
calibrated) rotation; `residual` = ResidualQuant: [2,2,2,4] g32, FP8 metadata, LS, Hadamard, last-loop
reference. Each ablation step of the paper's Figure 1 is one policy.

State (the layout of `rq_jax.cache.base`): per group position a `LoopSlot` of packed K and V codes
(`PackedCodes`: uint8 [G, N, B, K, S, D·b/8], scale/offset [G, N, B, K, S, D/g]) and α [G, N, B, K, S]
(bf16; None for the anchor and without least squares).

`attend` is split at the kernel seam: `operands` selects what slot (group, layer) and its reference
chain store — packed codes, metadata, α, key means — without unpacking anything, and an attention
implementation of the decode-attention op (`attention.PACKED`: XLA, the Pallas (Triton) kernel, the Mosaic
TPU kernel, the native CPU kernel; the policy's `attend_impl` picks) computes the partial from the
rotated queries: s_r = α_r·s_p(r) + q̃·D(c_r) + q̃·μ_r (recursively down to the anchor), and values
through the same recursion, p·ẑ_r = (α_r p)·ẑ_p + p·D(c_r), accumulated in the rotated basis. The op
takes the queries in the original basis and returns the output there: the XLA, Pallas and Mosaic
implementations rotate by XLA dots around their attention (`attend_packed`, `_kernel_partial`), the
native CPU kernel rotates each query row and accumulator itself. The XLA implementation does this one
context tile at a time (`base.tiled_partial`); the Pallas kernel walks its own tiles. `reconstruct`
(toolbox decode, un-rotate) is the reference.

Calibration (`RotationCalib`, per segment): rotations [G, N, K, D, D] for keys and values and key means
[G, N, p, K, D] (rotated basis, or None). `default_calib`: the policy's rotation kind, no means;
`calibrate` adds key means fitted on data when the policy asks for them (`key_means`).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from types import MappingProxyType
from typing import ClassVar, Mapping, NamedTuple

import cpu_kernels
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float
from pallas_kernels import QuantStream, residual_decode_attention
from pallas_kernels.tpu_residual_attention import tpu_residual_decode_attention

from rq_jax.cache import attention, base
from rq_jax.quant import affine, bits as qbits, residual, rotation, ste
from rq_jax.quant.packing import PackedCodes
from rq_jax.shapes import GroupedQueries, Lengths, NumNew, Queries, SegmentKV, SegmentPast, SlotKV, Visible

_HI = jax.lax.Precision.HIGHEST


class RotationCalib(NamedTuple):
    """Static calibration of a segment: rotations [G, N, K, D, D] (z = U x), key means [G, N, p, K, D]."""

    key_rot: Float[Array, "g n k d d"]
    value_rot: Float[Array, "g n k d d"]
    key_mean: Float[Array, "g n p k d"] | None = None


class LoopSlot(NamedTuple):
    """One group position: K and V codes ([G, N, B, K, S, ...]) and α [G, N, B, K, S] (None: no α)."""

    k: PackedCodes
    v: PackedCodes
    k_alpha: Array | None
    v_alpha: Array | None


class LoopOperands(NamedTuple):
    """What attention to one slot reads, nothing unpacked: the loop's reference chain, loop first, and the
    slot's rotations.

    `k`/`v`: packed codes of each chain link as stored (a super-scale not folded in), still stacked
    [G, N, B, K, S, ...] — `index` selects the slot (a kernel picks it in its index map).
    `k_alpha`/`v_alpha`: link i's α [G, N, B, K, S] scaling link i + 1 (None: α = 1); one fewer than links.
    `k_mean`: link i's key mean [K, D] (rotated basis) or None.
    `key_rot`/`value_rot`: the rotations [G, N, K, D, D] (z = U x), stacked as the codes are (`index` selects
    the slot's: the native kernel reads them where they lie, as it reads the codes).
    """

    index: base.Index
    k: tuple[PackedCodes, ...]
    v: tuple[PackedCodes, ...]
    k_alpha: tuple[Array | None, ...]
    v_alpha: tuple[Array | None, ...]
    k_mean: tuple[Array | None, ...]
    key_rot: Float[Array, "g n k d d"]
    value_rot: Float[Array, "g n k d d"]


def attend_packed(q: GroupedQueries, ops: LoopOperands, lengths: Lengths, table: base.Table | None = None,
                  visible: Visible | None = None) -> base.Partial:
    """The decode-attention op's XLA implementation: `attend_rotated` between the rotations, the queries
    q [B, T, K, H/K, D] float32 rotated by `ops.key_rot` before and acc [B, T, H, D] taken back by
    `ops.value_rot` after (m, l [B, T, H])."""
    return _unrotated(attend_rotated(_rotated(q, ops), ops, lengths, table, visible), ops, q.shape)


def _rotated(q: GroupedQueries, ops: LoopOperands) -> GroupedQueries:
    """Queries [B, T, K, H/K, D] in the rotated key basis."""
    return jnp.einsum("btkqd,ked->btkqe", q, base.at(ops.key_rot, ops.index), precision=_HI)


def _unrotated(part: base.Partial, ops: LoopOperands, grouped: tuple[int, ...]) -> base.Partial:
    """`part` with acc [B, T, H, D] taken from the rotated value basis back to the original one (`grouped`:
    the queries' [B, T, K, H/K, D])."""
    acc = jnp.einsum("btkqe,ked->btkqd", part.acc.reshape(grouped), base.at(ops.value_rot, ops.index), precision=_HI)
    return part._replace(acc=acc.reshape(part.acc.shape))


def attend_rotated(q_rot: GroupedQueries, ops: LoopOperands, lengths: Lengths, table: base.Table | None = None,
                   visible: Visible | None = None) -> base.Partial:
    """Softmax partial of rotated queries over a slot's stored tokens s < lengths[b] (read through `table`
    when paged) that `visible` (None: all) shows (XLA), one context tile at a time (`base.tiled_partial`):
    only a tile's codes, metadata and α are read out of the stacked state and dequantized.

    q_rot: [B, T, K, H/K, D] float32. Returns acc [B, T, H, D] in the rotated value basis, m, l [B, T, H].
    """
    b, t, heads, per_kv, d = q_rot.shape
    max_len, tile = base.tiling(ops.k[0].codes, table, b, t, heads * per_kv, d)

    def part(stored, start, valid):
        k, v, k_alpha, v_alpha = base.slot_tile(stored, ops.index, start, tile, table)
        return _rotated_partial(q_rot, k, v, k_alpha, v_alpha, ops.k_mean, valid)

    stored = (ops.k, ops.v, ops.k_alpha, ops.v_alpha)
    return base.tiled_partial(part, stored, (b, t, heads * per_kv, d), lengths, max_len, tile, visible)


def _rotated_partial(q_rot: GroupedQueries, k: tuple[PackedCodes, ...], v: tuple[PackedCodes, ...],
                     k_alpha: tuple[Array | None, ...], v_alpha: tuple[Array | None, ...],
                     k_mean: tuple[Array | None, ...], valid: Visible) -> base.Partial:
    """`attend_rotated` over one tile: the chain's codes [B, K, S, ...] and α [B, K, S] (`LoopOperands`'
    order), positions where `valid` [B, S]."""
    b, t, heads, per_kv, d = q_rot.shape
    scores = None
    for i in reversed(range(len(k))):  # from the anchor up: s_i = q̃·D(c_i) + q̃·μ_i + α_i·s_{i+1}
        s = jnp.einsum("btkqd,bksd->btkqs", q_rot, k[i].effective().dequantize())
        if k_mean[i] is not None:
            s = s + jnp.einsum("btkqd,kd->btkq", q_rot, k_mean[i])[..., None]
        if scores is not None:
            s = s + (scores if k_alpha[i] is None else _per_token(k_alpha[i]) * scores)
        scores = s
    scores = scores * d**-0.5
    size = scores.shape[-1]
    p, m, l = base.softmax_partial(scores.reshape(b, t, heads * per_kv, size),
                                   jnp.broadcast_to(valid[:, None, :], (b, t, size)))
    w, acc = p.reshape(scores.shape), 0.0
    for i in range(len(v)):  # Σ_s w_s ẑ_i,s, the weights scaled by α on the way down the chain
        acc = acc + jnp.einsum("btkqs,bksd->btkqd", w, v[i].effective().dequantize())
        if i + 1 < len(v) and v_alpha[i] is not None:
            w = w * _per_token(v_alpha[i])
    return base.Partial(acc.reshape(b, t, heads * per_kv, d), m, l)


def _kernel_partial(kernel, q: GroupedQueries, ops: LoopOperands, lengths: Lengths,
                    flat: bool = True, rotates: bool = False, **kw) -> base.Partial:
    """`attend_packed` through a decode kernel of `pallas_kernels.residual_decode_attention`'s signature
    (the Pallas kernel, or the native CPU kernel): queries as [B, K, T·H/K, D] rows, the chain's streams
    over the [G·N] slots (flattened when `flat`, else left stacked [G, N, ...] for a kernel that takes
    leading slot axes), key means as per-row mean scores. The rotations are XLA dots around the kernel,
    or the kernel's own when it `rotates` (the native kernel's `key_rot`/`value_rot` operands, stacked as the
    streams are, so that no slot's copy is cut out of the calibration: then the mean scores q̃·μ are taken
    as q·(U_kᵀμ))."""
    b, t, heads, per_kv, d = q.shape
    num_layers = ops.k[0].codes.shape[1]
    slot = ops.index[0] * num_layers + ops.index[1]
    def slots(x):  # [G, N, ...] → [G·N, ...]
        return x if x is None or not flat else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if rotates:
        kw.update(key_rot=slots(ops.key_rot), value_rot=slots(ops.value_rot))
        key_rot = base.at(ops.key_rot, ops.index)
        k_mean = tuple(None if mu is None else jnp.einsum("ke,ked->kd", mu, key_rot, precision=_HI)
                       for mu in ops.k_mean)
    else:
        q, k_mean = _rotated(q, ops), ops.k_mean
    q_rows = q.transpose(0, 2, 1, 3, 4).reshape(b, heads, t * per_kv, d)
    def streams(codes):
        codes = map(PackedCodes.effective, codes)
        return tuple(QuantStream(slots(c.codes), slots(c.scale), slots(c.offset)) for c in codes)
    means = tuple(None if mu is None else jnp.einsum("bkrd,kd->bkr", q_rows, mu) for mu in k_mean)
    acc, m, l = kernel(
        q_rows, streams(ops.k), streams(ops.v), tuple(map(slots, ops.k_alpha)), tuple(map(slots, ops.v_alpha)),
        means, lengths, jnp.asarray(slot, jnp.int32), k_bits=tuple(c.bits for c in ops.k),
        v_bits=tuple(c.bits for c in ops.v), k_group_sizes=tuple(c.group_size for c in ops.k),
        v_group_sizes=tuple(c.group_size for c in ops.v), **kw)
    def rows(x):
        rest = x.shape[3:]
        return jnp.moveaxis(x.reshape(b, heads, t, per_kv, *rest), 2, 1).reshape(b, t, heads * per_kv, *rest)
    part = base.Partial(rows(acc), rows(m), rows(l))
    return part if rotates else _unrotated(part, ops, q.shape)


@attention.PACKED.register("pallas")
def attend_pallas(q: GroupedQueries, ops: LoopOperands, lengths: Lengths,
                  table: base.Table | None = None) -> base.Partial:
    """`attend_packed` through the fused Pallas kernel (`pallas_kernels.residual_decode_attention`):
    compiled for Triton on a GPU, run in interpret mode elsewhere; rows through `table` when paged. Raises
    NotImplementedError (at trace time) for configurations the kernel does not cover."""
    return _kernel_partial(residual_decode_attention, q, ops, lengths, interpret=attention.target() != "cuda",
                           block_table=table)


@attention.PACKED.register("native")
def attend_native(q: GroupedQueries, ops: LoopOperands, lengths: Lengths,
                  table: base.Table | None = None) -> base.Partial:
    """`attend_packed` through the native CPU kernel (`cpu_kernels.residual_decode_attention`, XLA FFI),
    reading the codes where they lie, rows through `table` when paged, rotating the queries and the
    accumulator itself (one D×D product per row: no XLA dot around the call). Raises NotImplementedError (at
    trace time) for configurations it does not cover, or when the kernels cannot be built here."""
    return _kernel_partial(cpu_kernels.residual_decode_attention, q, ops, lengths, flat=False, rotates=True,
                           **({} if table is None else {"block_table": table}))


@attention.PACKED.register("pallas-tpu")
def attend_pallas_tpu(q: GroupedQueries, ops: LoopOperands, lengths: Lengths,
                      table: base.Table | None = None) -> base.Partial:
    """`attend_packed` through the Mosaic kernel (`pallas_kernels.tpu_residual_attention`): compiled for
    the TPU a program is lowered for, run in TPU interpret mode elsewhere; rows through `table` when paged.
    Raises NotImplementedError (at trace time) for configurations the kernel does not cover."""
    return _kernel_partial(tpu_residual_decode_attention, q, ops, lengths, interpret=attention.target() != "tpu",
                           block_table=table)


attention.PACKED.register("xla")(attend_packed)


class Coded(NamedTuple):
    """A loop group's K or V as a write stores it: per group position its packed codes and metadata
    (`PackedCodes` over [..., ·]), α [L', ...] bf16 of the positions with one (None: none), and per vector
    the values no field could hold [...] int32."""

    loops: tuple[PackedCodes, ...]
    alpha: Array | None
    lost: Array


@attention.ENCODE.register("xla")
def encode_xla(fmt: "LoopQuant", kind: str, z: Float[Array, "g n k p b t e"],
               mean: Float[Array, "g n k p b t e"] | None, num_new: NumNew) -> Coded:
    """The encode op in XLA: the quantization toolbox's group coding (`rq_jax.quant.residual`) of z with its loop
    axis first ([p, G, N, B, K, T, E]), packed; every token, num_new[b] or not."""
    cfg = fmt.group_config(z.shape[3], kind)
    z, mean = (None if x is None else jnp.transpose(x, (3, 0, 1, 4, 2, 5, 6)) for x in (z, mean))
    enc = fmt._encode(z, cfg, mean)
    loops = tuple(PackedCodes.from_quantized(enc.loops[r], cfg.quant_config(r)) for r in range(cfg.num_loops))
    return Coded(loops, enc.alpha, enc.out_of_range)


@attention.ENCODE.register("native")
def encode_native(fmt: "LoopQuant", kind: str, z: Float[Array, "g n k p b t e"],
                  mean: Float[Array, "g n k p b t e"] | None, num_new: NumNew) -> Coded:
    """The encode op through the native encoder (`cpu_kernels.residual_encode`, the same bits as XLA's), which
    reads z in the rotation's layout and writes the cache's, and codes only each row's tokens t < num_new[b]
    (the rest, a call's padding, are never stored; their results are zeros). Raises NotImplementedError (at
    trace time) for what it does not cover: super-scaled or float16/float32 metadata, 16-bit loops, or the
    library not built here."""
    cfg = fmt.group_config(z.shape[3], kind)
    if cfg.super_scale:
        raise NotImplementedError("super-scaled metadata (the native encoder stores plain FP8 or bf16 metadata)")
    if cfg.alpha_dtype != jnp.bfloat16:
        raise NotImplementedError(f"α in {cfg.alpha_dtype} (the native encoder stores bfloat16)")
    n = cfg.num_loops
    parents = [-1 if not fmt.residual or r == cfg.anchor else cfg.parent(r) for r in range(n)]
    loops, alpha, lost = cpu_kernels.residual_encode(
        z, mean, num_new, bits=cfg.bits, group_sizes=cfg.group_sizes,
        clips=[cfg.quant_config(r).clip_factor for r in range(n)], parents=parents,
        order=cfg.encode_order() if fmt.residual else tuple(range(n)), least_squares=cfg.least_squares,
        meta_dtype=cfg.meta_dtype)
    packed = tuple(PackedCodes(c, s, o, b, z.shape[-1], g) for (c, s, o), b, g in zip(loops, cfg.bits, cfg.group_sizes))
    if alpha is None and cfg.least_squares:  # a group of the anchor alone: no α rows, as the toolbox gives them
        alpha = jnp.zeros((0,) + lost.shape, jnp.bfloat16)
    return Coded(packed, alpha, lost)


def _rotate(x: Float[Array, "g p n b k t d"], u: Float[Array, "g n k e d"]) -> Float[Array, "g n k p b t e"]:
    """z = U x of a write's K or V, as [G, N, K, p, B, T, E]: the dot's own order (batch axes first), which the
    native encoder reads. XLA:CPU's dot wants U's contracted axis major, and copies every U transposed on each
    call when x comes first (2 × [G, N, K, D, D]: 8% of Ouro-small's decode step at one row); with U first it
    transposes x and z instead. So U goes first while a head's p·B·T vectors are fewer than its D channels (a
    decode step's few rows: −4% at one row), x first beyond (with U first, a step of 32 rows took 1% longer and
    a 256-token prompt chunk's rotation dots twice as long)."""
    vectors = x.shape[1] * x.shape[3] * x.shape[5]
    if vectors < x.shape[-1]:
        return jnp.moveaxis(jnp.einsum("gnked,gpnbktd->gnkepbt", u, x, precision=_HI), 3, -1)
    return jnp.einsum("gpnbktd,gnked->gnkpbte", x, u, precision=_HI)


@dataclasses.dataclass(frozen=True)
class LoopQuant(base.CacheFormat):
    """Loop-group quantization policy (see the module docstring); `name` is its registry name.

    `key_means`: `calibrate` fits per-(loop, layer, head) key means in the rotated basis.
    `super_scale`: store the FP8 metadata relative to a per-vector bfloat16 super-scale (NVFP4/MX
    style; 16 more bits per vector, counted) instead of plain FP8, which saturates at 448 and flushes
    below 2**-9. Either way `out_of_range` counts the metadata values the dtype could not hold.
    `attend_impl`: an implementation of the decode-attention op (`rq_jax.cache.attention`: "auto" is the
    kernel of the platform lowered for: Pallas on a GPU, Mosaic on a TPU, native on a CPU; "xla", "native",
    "pallas", "pallas-tpu"). `write_impl`: the same for the write's encoder (`attention.ENCODE`: "auto" is the
    native encoder on a CPU, XLA elsewhere; both store the same bits).

    Non-finite K/V entries are stored as 0 (before the rotation, which would spread them over the
    whole vector) and counted by `out_of_range`.
    """

    bits: int | tuple[int, ...] = (2, 2, 2, 4)
    group_size: int | tuple[int, ...] = 32
    bits_v: int | tuple[int, ...] | None = None
    group_size_v: int | tuple[int, ...] | None = None
    meta_dtype: str = "float8_e4m3fn"
    rotation: str = "hadamard"
    residual: bool = True
    least_squares: bool = True
    reference: str = "last"
    rotation_seed: int = 0
    key_means: bool = False
    super_scale: bool = False
    attend_impl: str = "auto"
    write_impl: str = "auto"
    name: str = "residual"
    needs_calib: bool = dataclasses.field(default=True, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)
    schedule_fields: ClassVar[tuple[str, ...]] = ("name", "bits", "group_size", "bits_v", "group_size_v",
                                                   "meta_dtype", "residual", "least_squares", "reference")
    calib_head_axes: ClassVar[Mapping[str, int]] = MappingProxyType({"key_rot": 2, "value_rot": 2, "key_mean": 3})
    learns_rotations: ClassVar[bool] = True
    reports_out_of_range: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "bits", tuple(int(b) for b in np.atleast_1d(self.bits)))
        object.__setattr__(self, "group_size", self._sizes(self.group_size, self.bits, "group_size"))
        if self.bits_v is not None:
            object.__setattr__(self, "bits_v", tuple(int(b) for b in np.atleast_1d(self.bits_v)))
            if len(self.bits_v) != len(self.bits):
                raise ValueError(f"{self.name}: bits_v {self.bits_v} needs one entry per loop of bits {self.bits}")
        if self.group_size_v is not None:
            object.__setattr__(self, "group_size_v", self._sizes(self.group_size_v, self.bits, "group_size_v"))
        if self.rotation not in rotation.ROTATION_KINDS:
            raise ValueError(f"unknown rotation {self.rotation!r}: expected one of {rotation.ROTATION_KINDS}")
        attention.check_impl(self.name, self.attend_impl)
        attention.check_impl(self.name, self.write_impl)
        if not self.residual and 0 in self.schedule("k")[0] + self.schedule("v")[0]:
            raise ValueError(f"{self.name}: a 0-bit loop stores nothing; only a residual loop can (residual=True)")
        for kind in "kv":  # validates bits, group sizes, metadata dtype and reference
            self.group_config(len(self.bits), kind)

    def _sizes(self, sizes, bits, field: str) -> tuple[int, ...]:
        sizes = (int(sizes),) * len(bits) if np.ndim(sizes) == 0 else tuple(int(g) for g in sizes)
        if len(sizes) != len(bits):
            raise ValueError(f"{self.name}: {field} {sizes} needs one entry per loop of bits {bits}")
        return sizes

    @property
    def group_len(self) -> int:
        """Loops per group: len(bits)."""
        return len(self.bits)

    def schedule(self, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(bits, group sizes) per group position of keys (kind "k") or values ("v"; the keys' unless
        `bits_v` / `group_size_v` say otherwise)."""
        if kind == "k":
            return self.bits, self.group_size
        return self.bits_v or self.bits, self.group_size_v or self.group_size

    def group_config(self, size: int, kind: str = "k") -> residual.ResidualConfig:
        """Toolbox config of a group of `size` loops for keys or values (least squares only with residuals)."""
        bits, sizes = self.schedule(kind)
        if self.residual:
            bits, sizes = bits[-size:], sizes[-size:]
        else:
            bits, sizes = bits[:size], sizes[:size]
        return residual.ResidualConfig(bits, sizes, meta_dtype=self.meta_dtype,
                                       least_squares=self.least_squares and self.residual,
                                       reference=self.reference, super_scale=self.super_scale)

    def chain(self, cfg: residual.ResidualConfig, loop: int) -> tuple[int, ...]:
        """The positions attention to `loop` reads: itself, then its references down to the anchor."""
        links = [loop]
        while self.residual and links[-1] != cfg.anchor:
            links.append(cfg.parent(links[-1]))
        return tuple(links)

    def _has_alpha(self, cfg: residual.ResidualConfig, loop: int) -> bool:
        return cfg.least_squares and loop != cfg.anchor

    # ---- the CacheFormat protocol -------------------------------------------------------------------

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[LoopSlot, ...]:
        """Zeroed codes, metadata and α for every position of the segment's groups."""
        bad = sorted({g for kind in "kv" for g in self.schedule(kind)[1] if head_dim % g})
        if bad:
            raise ValueError(f"{self.name} cache: group size(s) {bad} do not divide head_dim {head_dim}")
        lead = (seg.groups, num_layers, batch, num_kv_heads, max_len)
        cfgs = {kind: self.group_config(seg.size, kind) for kind in "kv"}

        def zeros(cfg, r):
            qc = cfg.quant_config(r)
            proto = jax.eval_shape(
                lambda: PackedCodes.from_quantized(affine.quantize(jnp.zeros(head_dim), qc), qc))
            return jax.tree_util.tree_map(lambda p: jnp.zeros(lead + p.shape, p.dtype), proto)

        def alpha(r):  # every leaf an array of its own: a donated cache must not hold one buffer twice
            return jnp.zeros(lead, cfgs["k"].alpha_dtype) if self._has_alpha(cfgs["k"], r) else None

        return tuple(LoopSlot(zeros(cfgs["k"], r), zeros(cfgs["v"], r), alpha(r), alpha(r)) for r in range(seg.size))

    def default_calib(self, seg, num_layers, num_kv_heads, head_dim) -> RotationCalib:
        """The policy's rotation for every group, layer and kv head (random: seeded), no key means."""
        shape = (seg.groups, num_layers, num_kv_heads, head_dim, head_dim)
        if self.rotation == "random":
            seed = jax.random.fold_in(jax.random.key(self.rotation_seed), seg.start)
            keys = jax.random.split(seed, 2 * int(np.prod(shape[:3])))
            mats = jax.vmap(lambda k: rotation.random_orthogonal(k, head_dim))(keys)
            return RotationCalib(*mats.reshape(2, *shape))
        u = jnp.broadcast_to(rotation.make_rotation(self.rotation, head_dim), shape)
        return RotationCalib(u, u)

    def calibrate(self, seg, k: SegmentPast, v: SegmentPast, lengths: Lengths) -> RotationCalib:
        """The default rotations, plus, when `key_means`, the key means fitted for them
        (`fit_key_means`). k, v: [G, p, N, B, K, S, D]."""
        calib = self.default_calib(seg, k.shape[2], k.shape[4], k.shape[6])
        if not self.key_means:
            return calib
        return calib._replace(key_mean=self.fit_key_means(k, lengths, calib.key_rot))

    def calib_shapes(self, seg, num_layers, num_kv_heads, head_dim) -> RotationCalib:
        """Rotations [G, N, K, D, D] for keys and values and the optional key means [G, N, p, K, D]
        (learned rotations, e.g. OptR-H's, come with means whatever `key_means` says)."""
        full = dataclasses.replace(self, key_means=True)
        return base.CacheFormat.calib_shapes(full, seg, num_layers, num_kv_heads, head_dim)

    def schedule_name(self, num_loops: int) -> str:
        """E.g. "residual-b2.2.2.4-g32-L4" (group sizes once when they are all equal)."""
        def spell(bits, sizes):
            sizes = sizes if len(set(sizes)) > 1 else sizes[:1]
            return f"b{'.'.join(map(str, bits))}-g{'.'.join(map(str, sizes))}"

        keys, values = spell(*self.schedule("k")), spell(*self.schedule("v"))
        return f"{self.name}-{keys}" + ("" if values == keys else f"-v{values}") + f"-L{num_loops}"

    def fit_key_means(self, k: SegmentPast, lengths: Lengths,
                      key_rot: Float[Array, "g n k d d"]) -> Float[Array, "g n p k d"]:
        """Per-(loop, layer, kv head) key means [G, N, p, K, D] for the key rotations `key_rot`: the mean
        over tokens s < lengths[b] of each loop's quantization target in the rotated basis (the anchor's
        key; a residual loop's key minus its scaled reference, itself encoded with the means fitted so
        far). k: [G, p, N, B, K, S, D]. Used by `calibrate` (default rotations) and by
        `rq_jax.calibrate` (learned rotations)."""
        cfg = self.group_config(k.shape[1])
        z = jnp.einsum("gpnbksd,gnked->pgnbkse", k.astype(jnp.float32), key_rot, precision=_HI)
        valid = base.valid_tokens(lengths, k.shape[5]).astype(jnp.float32)[None, None, :, None, :, None]
        means = jnp.zeros(z.shape[:3] + (1, z.shape[4], 1, z.shape[6]), jnp.float32)  # [p, G, N, 1, K, 1, D]
        for r in (cfg.encode_order() if self.residual else range(cfg.num_loops)):
            target = z[r]
            if self.residual and r != cfg.anchor:
                enc, recon = residual.encode_decode_group(z, cfg, means)
                target = z[r] - (recon[r] - affine.dequantize(enc.loops[r], cfg.quant_config(r)) - means[r])
            mean = jnp.sum(target * valid, axis=(2, 4), keepdims=True) / jnp.maximum(jnp.sum(valid), 1.0)
            means = means.at[r].set(mean)
        return jnp.moveaxis(means[:, :, :, 0, :, 0], 0, 2)

    def write(self, state, k: SegmentKV, v: SegmentKV, lengths: Lengths, num_new: NumNew, calib: RotationCalib,
              table: base.Table | None = None) -> base.Written:
        """Rotate K/V [G, p, N, B, K, T, D] (XLA; non-finite entries zeroed and counted), encode every group
        through `write_impl` (the encode op: XLA, or the native encoder on a CPU, the same bits) and store
        at lengths[b] + t (through `table` when paged). Per row, the new tokens' (t < num_new[b]) metadata
        values the metadata dtype could not hold (saturated or flushed to zero) plus their non-finite
        entries, summed over slots, are the out-of-range count."""
        cfg = self.group_config(k.shape[1], "k")  # the α layout (which positions have one) is the same for K and V
        coded, lost = {}, 0
        for kind, x, u in (("k", k, calib.key_rot), ("v", v, calib.value_rot)):
            x = x.astype(jnp.float32)
            finite = jnp.isfinite(x)
            z = _rotate(jnp.where(finite, x, 0.0), u)
            mean = None if kind == "v" or calib.key_mean is None else jnp.broadcast_to(
                jnp.moveaxis(calib.key_mean, 3, 2)[:, :, :, :, None, None, :], z.shape)
            coded[kind] = attention.ENCODE(self.write_impl, self, kind, z, mean, num_new, who=self.name)
            # [G, N, B, K, T]; summed over channels first (XLA:CPU otherwise writes the mask out as int32)
            lost = lost + coded[kind].lost + jnp.sum(jnp.sum(~finite, axis=-1, dtype=jnp.int32), axis=1)
        new = tuple(LoopSlot(coded["k"].loops[r], coded["v"].loops[r],
                             *(coded[kind].alpha[cfg.alpha_index(r)] if self._has_alpha(cfg, r) else None
                               for kind in "kv"))
                    for r in range(cfg.num_loops))
        fresh = jnp.arange(k.shape[5])[None, :] < num_new[:, None]  # [B, T]
        lost = jnp.sum(jnp.where(fresh[:, None], lost, 0), axis=(0, 1, 3, 4))
        return base.Written(base.scatter_tokens(state, new, lengths, num_new, table), lost.astype(lengths.dtype))

    def _encode(self, z: Float[Array, "p ... d"], cfg, mean) -> residual.EncodedGroup:
        """Residual group coding, or (direct) every position coded on its own."""
        if self.residual:
            return residual.encode_group(z, cfg, mean)
        parts = [residual.encode_group(z[r : r + 1], self._direct(cfg, r), None if mean is None else mean[r : r + 1])
                 for r in range(cfg.num_loops)]
        return residual.EncodedGroup(tuple(e.loops[0] for e in parts), None, sum(e.out_of_range for e in parts))

    def _direct(self, cfg: residual.ResidualConfig, r: int) -> residual.ResidualConfig:
        """The one-loop config of position r in a direct (residual-free) group."""
        return residual.ResidualConfig(cfg.bits[r : r + 1], cfg.group_sizes[r : r + 1], meta_dtype=cfg.meta_dtype,
                                       super_scale=cfg.super_scale)

    def fake_quant(self, k: SegmentKV, v: SegmentKV, calib: RotationCalib) -> tuple[Array, Array]:
        """What `write` then `reconstruct` give for K/V [G, p, N, B, K, T, D], float32, with straight-
        through gradients to k and v (references stopped) — for quantization-aware training."""
        out = []
        for kind, x, u in (("k", k, calib.key_rot), ("v", v, calib.value_rot)):
            cfg = self.group_config(k.shape[1], kind)
            z = jnp.einsum("gpnbktd,gnked->pgnbkte", x.astype(jnp.float32), u, precision=_HI)
            mean = None if kind == "v" or calib.key_mean is None else \
                jnp.moveaxis(calib.key_mean, 2, 0)[:, :, :, None, :, None, :]  # [p, G, N, 1, K, 1, D]
            if self.residual:
                zq = ste.ste_residual_group(z, cfg, mean)
            else:
                zq = jnp.concatenate([ste.ste_residual_group(z[r : r + 1], self._direct(cfg, r),
                                                             None if mean is None else mean[r : r + 1])
                                      for r in range(cfg.num_loops)])
            out.append(jnp.einsum("pgnbkte,gnked->gpnbktd", zq, u, precision=_HI))
        return tuple(out)

    def operands(self, state: tuple[LoopSlot, ...], index: base.Index, loop: int,
                 calib: RotationCalib) -> LoopOperands:
        """Select slot `index`'s operands for group position `loop` (the kernel seam's first half)."""
        links = self.chain(self.group_config(len(state)), loop)
        means = None if calib.key_mean is None else calib.key_mean[index]  # [p, K, D]
        return LoopOperands(
            index,
            tuple(state[r].k for r in links), tuple(state[r].v for r in links),
            tuple(state[r].k_alpha for r in links[:-1]), tuple(state[r].v_alpha for r in links[:-1]),
            tuple(None if means is None else means[r] for r in links), calib.key_rot, calib.value_rot)

    def attend(self, state, index, loop, q: Queries, lengths: Lengths, calib: RotationCalib,
               visible: Visible | None = None, table: base.Table | None = None) -> base.Partial:
        """Run `attend_impl` on the queries and the slot's operands (through `table` when paged; XLA
        fallback; XLA too under a `visible` mask): it rotates the queries and un-rotates its result, by XLA
        dots around a kernel or, natively, inside it. A prompt call (T > 1) whose rows hold no past
        yet (a fresh prompt's first chunk) skips all of it under a `lax.cond`: the rotations cost as much as
        a layer's projections there. The state enters the cond on its bits (`base.tree_bits`: a converted
        copy of a whole leaf is never made)."""
        if q.shape[1] == 1:
            return self._attend(state, index, loop, q, lengths, calib, visible, table)
        bits, dtypes = base.tree_bits(state)

        def read(bits, q):
            part = self._attend(base.tree_values(bits, dtypes), index, loop, q, lengths, calib, visible, table)
            return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), part)

        return jax.lax.cond(jnp.max(lengths) > 0, read, lambda bits, q: base.empty_partial(*q.shape), bits, q)

    def _attend(self, state, index, loop, q: Queries, lengths: Lengths, calib: RotationCalib,
                visible: Visible | None, table: base.Table | None) -> base.Partial:
        q = base.group_queries(q, calib.key_rot.shape[2]).astype(jnp.float32)
        ops = self.operands(state, index, loop, calib)
        if visible is not None:  # the kernels take no mask
            return attend_packed(q, ops, lengths, table, visible)
        return attention.PACKED(self.attend_impl, q, ops, lengths, table, who=self.name)

    def reconstruct(self, state, index, loop, lengths: Lengths, calib: RotationCalib) -> tuple[SlotKV, SlotKV]:
        """Decode slot `index` at position `loop` with the toolbox, then un-rotate: [B, K, S, D] each."""
        mean = None if calib.key_mean is None else calib.key_mean[index][:, None, :, None, :]  # [p, 1, K, 1, D]
        out = []
        for kind, u in (("k", calib.key_rot[index]), ("v", calib.value_rot[index])):
            cfg = self.group_config(len(state), kind)
            slots = [base.at(s, index) for s in state]
            codes = tuple(getattr(s, kind).unpacked() for s in slots)
            m = None if kind == "v" else mean
            if self.residual:
                alphas = [getattr(s, kind + "_alpha") for s in slots if getattr(s, kind + "_alpha") is not None]
                enc = residual.EncodedGroup(codes, jnp.stack(alphas) if alphas else None)
                z = residual.decode_loop(enc, cfg, loop, m)
            else:
                enc = residual.EncodedGroup(codes[loop : loop + 1], None)
                z = residual.decode_loop(enc, self._direct(cfg, loop), 0, None if m is None else m[loop : loop + 1])
            x = jnp.einsum("bkse,ked->bksd", z, u, precision=_HI)
            out.append(jnp.where(base.valid_tokens(lengths, x.shape[2])[:, None, :, None], x, 0.0))
        return tuple(out)

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Average stored bits per K or V element over the loops and over K and V, by the toolbox's
        accounting (the same at every context length)."""
        total = Fraction(0)
        for seg in base.segments(num_loops, self.group_len):
            for kind in "kv":
                cfg = self.group_config(seg.size, kind)
                group = (qbits.residual_bits(cfg, head_dim) if self.residual else
                         qbits.direct_bits([cfg.quant_config(r) for r in range(seg.size)], head_dim))
                total += group * seg.num_loops
        return total / (2 * num_loops)

    def read_bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Bits attention reads per cached element, averaged over the loops: a residual loop reads its
        reference chain (its own codes, metadata and α, then each reference's down to the anchor);
        without residuals a loop reads what it stores. Ouro's [2,2,2,4] g32: 3.09 stored, 6.47 read."""
        if not self.residual:
            return self.bits_per_element(num_loops, head_dim)
        total = Fraction(0)
        for seg in base.segments(num_loops, self.group_len):
            for kind in "kv":
                cfg = self.group_config(seg.size, kind)
                for r in range(seg.size):
                    links = self.chain(cfg, r)
                    bits = sum(qbits.affine_bits(cfg.quant_config(i), head_dim) for i in links)
                    if cfg.least_squares:
                        bits += Fraction(8 * cfg.alpha_dtype.itemsize * (len(links) - 1), head_dim)
                    total += bits * seg.groups
        return total / (2 * num_loops)

    def kernel_chains(self, num_loops: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
        """The distinct (key links, value links) of the decode-kernel calls this format makes at
        `num_loops` loops, one per group position: (bits, group size) per chain link, the loop first and
        its references after it down to the anchor (`chain`), as `pallas_kernels.configs` names calls."""
        out = []
        for seg in base.segments(num_loops, self.group_len):
            cfgs = [self.group_config(seg.size, kind) for kind in "kv"]
            for r in range(seg.size):
                links = self.chain(cfgs[0], r)
                pair = tuple(tuple((c.bits[i], c.group_sizes[i]) for i in links) for c in cfgs)
                if pair not in out:
                    out.append(pair)
        return tuple(out)

    def describe(self) -> str:
        """E.g. "INT2/INT4 g32 codes + fp8 meta + bf16 α, Hadamard-rotated residuals" (K and V schedules
        spelled apart when they differ)."""
        def codes(kind):
            bits, sizes = self.schedule(kind)
            return (f"{'/'.join(f'INT{b}' if b else '0-bit' for b in sorted(set(bits)))} "
                    f"{'/'.join(f'g{g}' for g in sorted(set(sizes)))}")

        keys, values = codes("k"), codes("v")
        spelled = keys if keys == values else f"K {keys}, V {values}"
        meta = {"float8_e4m3fn": "fp8", "bfloat16": "bf16", "float16": "fp16", "float32": "f32"}.get(
            self.meta_dtype, self.meta_dtype)
        out = f"{spelled} codes + {meta} meta" + (" + bf16 super-scale" if self.super_scale else "")
        if self.residual and self.least_squares:
            out += " + bf16 α"
        how = [{"identity": "", "hadamard": "Hadamard-rotated", "random": "randomly rotated"}[self.rotation]]
        how += ["residuals"] if self.residual else []
        return out + (f", {' '.join(filter(None, how))}" if any(how) else "")


def _per_token(alpha: Float[Array, "b k s"]) -> Float[Array, "b 1 k 1 s"]:
    """α of each stored token, broadcast against scores [B, T, K, H/K, S]."""
    return alpha.astype(jnp.float32)[:, None, :, None, :]


def _named(name: str, **defaults):
    def make(**policy) -> LoopQuant:
        return LoopQuant(**{**defaults, **policy, "name": name})

    make.__doc__ = f"The `{name}` format: `LoopQuant` with defaults {defaults}."
    return base.register(name)(make)


uniform = _named("uniform", bits=(2,), residual=False, rotation="identity")
rotated = _named("rotated", bits=(2,), residual=False, rotation="hadamard")
residual_quant = _named("residual")
