"""Loop-group quantized KV: ResidualQuant (`residual`) and its baselines `uniform` and `rotated`.

The loops of a slot's layer are split into consecutive groups of `len(bits)` loops (Ouro's 4 loops:
one group; Huginn's 32 steps: 8 groups of 4, each anchored on its own last step). A final partial
group of m < len(bits) loops uses the last m entries of `bits`, so its anchor keeps the anchor width.
Per group, in the rotated basis z = U x (U per group, layer and kv head; keys and values separately):

    residual=True:   anchor quantized first; every other loop r stores Q(z_r − α_r·ẑ_p(r) − μ_r) and
                     α_r = <z_r, ẑ_p> / |ẑ_p|² (bf16), against the *reconstructed* reference (toolbox
                     `rq_jax.quant.residual`); key means μ only for keys.
    residual=False:  every loop quantized on its own with bits[position] (the paper's "Direct").

`uniform` = residual off, identity rotation; `rotated` = residual off, Hadamard (or random, or
calibrated) rotation; `residual` = ResidualQuant: [2,2,2,4] g32, FP8 metadata, LS, Hadamard, last-loop
reference. Each ablation step of the paper's Figure 1 is one policy.

Storage per loop (tuples over loops, since widths differ): packed uint8 codes [N, B, K, S, D·b/8],
scale/offset [N, B, K, S, D/g] in the metadata dtype, and α [N, B, K, S] (bf16) for non-anchor loops.

`attend` is the fused XLA path: it never rebuilds K̂/V̂ of a loop. Scores use the rotated query,
s_r = α_r·s_p(r) + q̃·D(c_r) + q̃·μ_r (recursively down to the anchor), and probabilities are pushed
through the same recursion for values, p·ẑ_r = (α_r p)·ẑ_p + p·D(c_r), accumulated in the rotated
basis and un-rotated once. `reconstruct` (decode codes, add references, un-rotate) is its reference.

Calibration (`RotationCalib`): rotations [G_loops, N, K, D, D] for keys and values and key means
[L, N, K, D] (rotated basis). Default: the policy's rotation kind for every group, layer and head,
and zero means.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from rq_jax.cache import base
from rq_jax.quant import affine, bits as qbits, packing, residual, rotation


class RotationCalib(NamedTuple):
    """Static calibration: rotations [G_loops, N, K, D, D] (z = U x) and optional key means [L, N, K, D]."""

    key_rot: Float[Array, "g n k d d"]
    value_rot: Float[Array, "g n k d d"]
    key_mean: Float[Array, "l n k d"] | None = None


class LoopCodes(NamedTuple):
    """One loop's stored K or V: packed codes [N, B, K, S, D·b/8], scale/offset [N, B, K, S, D/g]."""

    codes: Array
    scale: Array
    offset: Array


class ResidualState(NamedTuple):
    """Per loop (tuples of length L): K and V codes, and α [N, B, K, S] (None for anchors / LS off)."""

    k: tuple[LoopCodes, ...]
    v: tuple[LoopCodes, ...]
    k_alpha: tuple[Array | None, ...]
    v_alpha: tuple[Array | None, ...]


@dataclasses.dataclass(frozen=True)
class LoopQuant:
    """Loop-group quantization policy (see the module docstring); `name` is its registry name."""

    bits: tuple[int, ...] = (2, 2, 2, 4)
    group_size: int | tuple[int, ...] = 32
    meta_dtype: str = "float8_e4m3fn"
    rotation: str = "hadamard"
    residual: bool = True
    least_squares: bool = True
    reference: str = "last"
    rotation_seed: int = 0
    name: str = "residual"
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        object.__setattr__(self, "bits", tuple(int(b) for b in np.atleast_1d(self.bits)))
        sizes = self.group_size
        sizes = (int(sizes),) * len(self.bits) if np.ndim(sizes) == 0 else tuple(int(g) for g in sizes)
        object.__setattr__(self, "group_size", sizes)
        if self.rotation not in rotation.ROTATION_KINDS:
            raise ValueError(f"unknown rotation {self.rotation!r}: expected one of {rotation.ROTATION_KINDS}")
        self.group_config(len(self.bits))  # validates bits, group sizes, metadata dtype and reference

    @property
    def group_len(self) -> int:
        """Loops per group: len(bits) with residuals, else 1 (every loop independent)."""
        return len(self.bits) if self.residual else 1

    def groups(self, num_loops: int) -> list[range]:
        """Consecutive loop groups; the last may be shorter."""
        n = self.group_len
        return [range(s, min(s + n, num_loops)) for s in range(0, num_loops, n)]

    def group_config(self, size: int, first: int = 0) -> residual.ResidualConfig:
        """Toolbox config of a group of `size` loops starting at loop `first`."""
        if self.residual:
            bits, sizes = self.bits[-size:], self.group_size[-size:]
        else:
            pos = first % len(self.bits)
            bits, sizes = (self.bits[pos],), (self.group_size[pos],)
        return residual.ResidualConfig(bits, sizes, meta_dtype=self.meta_dtype,
                                       least_squares=self.least_squares and self.residual,
                                       reference=self.reference)

    def _loop(self, num_loops: int, loop: int) -> tuple[int, range, residual.ResidualConfig]:
        """(group index, group loops, group config) of a loop."""
        for i, g in enumerate(self.groups(num_loops)):
            if loop in g:
                return i, g, self.group_config(len(g), g.start)
        raise ValueError(f"loop {loop} outside 0..{num_loops - 1}")

    # ---- the CacheFormat protocol -------------------------------------------------------------------

    def init(self, num_loops, num_layers, batch, max_len, num_kv_heads, head_dim) -> ResidualState:
        """Zeroed codes, metadata and α for every loop."""
        bad = sorted({g for g in self.group_size if head_dim % g})
        if bad:
            raise ValueError(f"{self.name} cache: group size(s) {bad} do not divide head_dim {head_dim}")
        lead = (num_layers, batch, num_kv_heads, max_len)
        k, alpha = [], []
        for g in self.groups(num_loops):
            cfg = self.group_config(len(g), g.start)
            for r in range(len(g)):
                q = cfg.quant_config(r)
                proto = jax.eval_shape(lambda: _stored(affine.quantize(jnp.zeros(head_dim), q), q.bits))
                k.append(LoopCodes(*(jnp.zeros(lead + p.shape, p.dtype) for p in proto)))
                has_alpha = cfg.least_squares and r != cfg.anchor
                alpha.append(jnp.zeros(lead, cfg.alpha_dtype) if has_alpha else None)
        return ResidualState(tuple(k), tuple(k), tuple(alpha), tuple(alpha))

    def default_calib(self, num_loops, num_layers, num_kv_heads, head_dim) -> RotationCalib:
        """The policy's rotation for every group, layer and kv head (random: seeded), zero key means."""
        shape = (len(self.groups(num_loops)), num_layers, num_kv_heads, head_dim, head_dim)
        if self.rotation == "random":
            keys = jax.random.split(jax.random.key(self.rotation_seed), 2 * int(np.prod(shape[:3])))
            mats = jax.vmap(lambda k: rotation.random_orthogonal(k, head_dim))(keys)
            return RotationCalib(*mats.reshape(2, *shape))
        u = jnp.broadcast_to(rotation.make_rotation(self.rotation, head_dim), shape)
        return RotationCalib(u, u)

    def calibrate(self, k, v, lengths) -> RotationCalib:
        """No data needed: the default calibration (learned rotations and means come from calibration)."""
        return self.default_calib(k.shape[0], k.shape[1], k.shape[3], k.shape[5])

    def _calib(self, calib, num_loops, num_layers, num_kv_heads, head_dim) -> RotationCalib:
        return calib if calib is not None else self.default_calib(num_loops, num_layers, num_kv_heads, head_dim)

    def write(self, state: ResidualState, k, v, lengths, num_new, calib) -> ResidualState:
        """Rotate, encode every loop group of K/V [L, N, B, K, T, D] and store at lengths[b] + t."""
        num_loops, num_layers, _, heads, _, dim = k.shape
        calib = self._calib(calib, num_loops, num_layers, heads, dim)
        new = {"k": [], "v": [], "k_alpha": [], "v_alpha": []}
        for i, g in enumerate(self.groups(num_loops)):
            cfg = self.group_config(len(g), g.start)
            for kind, x, u in (("k", k, calib.key_rot), ("v", v, calib.value_rot)):
                z = _rotate_kv(x[g.start : g.stop], u[i])
                mean = None if kind == "v" or calib.key_mean is None else _mean(calib.key_mean[g.start : g.stop])
                enc = residual.encode_group(z, cfg, mean)
                for r, q in enumerate(enc.loops):
                    new[kind].append(_stored(q, cfg.bits[r]))
                    new[kind + "_alpha"].append(
                        enc.alpha[cfg.alpha_index(r)] if cfg.least_squares and r != cfg.anchor else None)
        update = ResidualState(*(tuple(new[f]) for f in ResidualState._fields))
        return base.scatter_tokens(state, update, lengths, num_new, token_axis=3)

    def _group_codes(self, state: ResidualState, kind: str, g: range, layer: int, cfg) -> residual.EncodedGroup:
        """The toolbox's EncodedGroup of one layer (codes unpacked), leaves [B, K, S, ...]."""
        codes = getattr(state, kind)
        loops = tuple(
            affine.Quantized(packing.unpack(codes[r].codes[layer], cfg.bits[j],
                                            packing.unpacked_dim(codes[r].codes.shape[-1], cfg.bits[j])),
                             codes[r].scale[layer], codes[r].offset[layer])
            for j, r in enumerate(g))
        alphas = [getattr(state, kind + "_alpha")[r] for r in g if getattr(state, kind + "_alpha")[r] is not None]
        return residual.EncodedGroup(loops, jnp.stack([a[layer] for a in alphas]) if alphas else None)

    def reconstruct(self, state: ResidualState, loop, layer, calib):
        """Decode slot (loop, layer): anchor, references and α per the toolbox, then un-rotate. [B,K,S,D]."""
        num_loops = len(state.k)
        i, g, cfg = self._loop(num_loops, loop)
        dim = packing.unpacked_dim(state.k[loop].codes.shape[-1], cfg.bits[loop - g.start])
        calib = self._calib(calib, num_loops, state.k[0].codes.shape[0], state.k[0].scale.shape[2], dim)
        out = []
        for kind, u in (("k", calib.key_rot), ("v", calib.value_rot)):
            mean = None if kind == "v" or calib.key_mean is None else _mean(calib.key_mean[g.start : g.stop, layer])
            z = residual.decode_loop(self._group_codes(state, kind, g, layer, cfg), cfg, loop - g.start, mean)
            out.append(_unrotate_kv(z, u[i, layer]))
        return tuple(out)

    def attend(self, state: ResidualState, q, loop, layer, lengths, calib) -> base.Partial:
        """Fused path: rotated-query scores through the reference recursion, rotated-space values."""
        num_loops = len(state.k)
        i, g, cfg = self._loop(num_loops, loop)
        b, t, h, d = q.shape
        heads = state.k[0].scale.shape[2]
        calib = self._calib(calib, num_loops, state.k[0].codes.shape[0], heads, d)
        keys = self._group_codes(state, "k", g, layer, cfg)
        vals = self._group_codes(state, "v", g, layer, cfg)
        q_rot = jnp.einsum("btkqd,ked->btkqe", base.group_queries(q, heads).astype(jnp.float32),
                           calib.key_rot[i, layer], precision=jax.lax.Precision.HIGHEST)
        means = None if calib.key_mean is None else calib.key_mean[g.start : g.stop, layer]

        def scores(r):  # q̃·ẑ_r of loop r (position in group), [B, T, K, Gq, S]
            s = jnp.einsum("btkqd,bksd->btkqs", q_rot, affine.dequantize(keys.loops[r], cfg.quant_config(r)))
            if means is not None:
                s = s + jnp.einsum("btkqd,kd->btkq", q_rot, means[r])[..., None]
            if r != cfg.anchor:
                parent = scores(cfg.parent(r))
                s = s + (parent if keys.alpha is None else _per_token(keys.alpha[cfg.alpha_index(r)]) * parent)
            return s

        def values(r, w):  # Σ_s w_s ẑ_r,s in the rotated basis, [B, T, K, Gq, D]
            acc = jnp.einsum("btkqs,bksd->btkqd", w, affine.dequantize(vals.loops[r], cfg.quant_config(r)))
            if r != cfg.anchor:
                w = w if vals.alpha is None else w * _per_token(vals.alpha[cfg.alpha_index(r)])
                acc = acc + values(cfg.parent(r), w)
            return acc

        r = loop - g.start
        s = scores(r) * d**-0.5
        p, m, l = base.softmax_partial(s.reshape(b, t, h, -1), base.past_mask(lengths, t, s.shape[-1]))
        acc = values(r, p.reshape(s.shape))
        acc = jnp.einsum("btkqe,ked->btkqd", acc, calib.value_rot[i, layer], precision=jax.lax.Precision.HIGHEST)
        return base.Partial(acc.reshape(b, t, h, d), m, l)

    def nbytes(self, state: ResidualState) -> int:
        """Bytes of codes, metadata and α."""
        return base.tree_nbytes(state)

    def bits_per_element(self, num_loops: int, head_dim: int) -> Fraction:
        """Average stored bits per K or V element over the loops, by the toolbox's accounting."""
        total = sum((qbits.residual_bits(self.group_config(len(g), g.start), head_dim) * len(g)
                     for g in self.groups(num_loops)), Fraction(0))
        return total / num_loops


def _stored(q: affine.Quantized, bits: int) -> LoopCodes:
    """What a loop stores: its codes packed, and its metadata."""
    return LoopCodes(packing.pack(q.codes, bits), q.scale, q.offset)


def _rotate_kv(x: Float[Array, "l n b k t d"], u: Float[Array, "n k d d"]) -> Float[Array, "l n b k t d"]:
    """z = U x with U per layer and kv head."""
    return jnp.einsum("lnbktd,nked->lnbkte", x.astype(jnp.float32), u, precision=jax.lax.Precision.HIGHEST)


def _unrotate_kv(z: Float[Array, "b k s d"], u: Float[Array, "k d d"]) -> Float[Array, "b k s d"]:
    """x = Uᵀ z with U per kv head."""
    return jnp.einsum("bkse,ked->bksd", z, u, precision=jax.lax.Precision.HIGHEST)


def _mean(mean: Float[Array, "l ... k d"]) -> Array:
    """Key means [L, (N,) K, D] broadcast against codes [L, (N,) B, K, S, D]."""
    return mean[..., None, :, None, :]


def _per_token(alpha: Float[Array, "b k s"]) -> Float[Array, "b 1 k 1 s"]:
    """α of each stored token, broadcast against scores [B, T, K, Gq, S]."""
    return alpha.astype(jnp.float32)[:, None, :, None, :]


def _named(name: str, **defaults):
    def make(**policy) -> LoopQuant:
        return LoopQuant(**{**defaults, **policy, "name": name})

    make.__doc__ = f"The `{name}` format: `LoopQuant` with defaults {defaults}."
    return base.register(name)(make)


uniform = _named("uniform", bits=(2,), residual=False, rotation="identity")
rotated = _named("rotated", bits=(2,), residual=False, rotation="hadamard")
residual_quant = _named("residual")
