"""Native CPU decode-attention kernels over rq_jax's cache layouts (XLA FFI, C++).

The CPU counterpart of `pallas_kernels`: the same array layouts and the same signatures as its
`*_reference` functions, so a caller swaps one for the other. This package imports nothing from rq_jax.

    dense_decode_attention(q, k, v, lengths, slot)                  bf16 / f32 K/V
    residual_decode_attention(q, keys, values, k_alpha, v_alpha, mean_scores, lengths, slot, ...)
                                                                    packed chains: uniform, rotated,
                                                                    ResidualQuant of any length; given
                                                                    key_rot and value_rot, it rotates the
                                                                    queries and the result itself

    residual_encode(z, mean, bits=..., group_sizes=..., clips=..., parents=..., order=..., ...)
                                                                    the write's encoder: a loop group of
                                                                    rotated K or V as ResidualQuant codes it

    store_tokens(pool, new, lengths, num_new, block_table)         the write's store: a call's new tokens
                                                                    into a paged pool, every leaf at once,
                                                                    in place

Stored leaves may stack their slots over several leading axes ([G, N, B, K, S, ...], as rq_jax's state
holds them): the axes before B are the slots, row-major, and `slot` indexes their flattening (so a caller
passes the state's own buffers, with no reshape between them and the kernel).

Rows are read through a block table: with `block_table` [B, N] (int32) a slot's leaves are a pool of pages,
[..., NP, K, P, ...], and row b's tokens [nP, (n+1)P) lie in page block_table[b, n] (the paged cache); left
out, the leaves are contiguous rows [..., B, K, S, ...], which is the identity table [B, 1] over pages of
P = S tokens. Only the pages a row's length reaches are read, and each must lie in the pool (else the call
fails naming it); the rest of a row's table may hold anything.

Each attention returns the unnormalised partial (acc [B, K, R, D], m, l [B, K, R], float32; a row with
no stored token: m = -1e30, l = 0, acc = 0). The C++ (`src/`) reads the codes where they lie — per
stored token each chain link's bytes unpacked plane by plane, group scales and offsets applied per
group, α chained, online softmax — split over (row, kv head, 512-token context slices) on XLA's CPU
thread pool, the slices merged in a fixed order (the same bits at any thread count). It is compiled on
first use (`cpu_kernels.build`), with AVX-512, AVX2 and baseline x86-64 variants chosen at load time.

On several devices the calls are partitioned (`jax.experimental.custom_partitioning`): rows and kv heads
split as the query is, each device runs the kernel on its own rows and heads of the stored leaves (a
contiguous cache's identity table is each device's own), and nothing of the cache is gathered; a paged
pool is kept whole along the rows (its pages are shared by every row).

A function raises NotImplementedError (at trace time) for what it does not cover — or everything,
when the library cannot be built or loaded here (`unavailable_reason()` says why; RQ_JAX_NATIVE=0
turns it off) — so a caller can fall back to XLA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from cpu_kernels import build

log = logging.getLogger(__name__)

NEG = -1e30
SUPPORTED_BITS = (1, 2, 4, 8)
SUPPORTED_META = (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16, jnp.float32)
#: The kernels' code of each metadata dtype (src/kernels.h, `Meta`).
_META_CODE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2,
              jnp.dtype(jnp.float8_e4m3fn): 3}
MAX_HEAD_DIM = 512
MAX_LINKS = 8
_TARGETS = {"dense": "RqDenseAttention", "quant": "RqQuantAttention", "encode": "RqEncode", "store": "RqStore"}


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library with its FFI targets registered, "") or (None, why not)."""
    if os.environ.get("RQ_JAX_NATIVE", "1") == "0":
        return None, "turned off (RQ_JAX_NATIVE=0)"
    try:
        lib = ctypes.CDLL(str(build.library()))
    except (build.BuildError, OSError) as err:
        why = f"could not be built or loaded: {err}"
        log.warning("native CPU kernels %s; decode attention runs on XLA", why)
        return None, why
    for kind, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(f"rq_cpu_{kind}", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.RqCpuIsa.restype = ctypes.c_char_p
    return lib, ""


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why the native kernels cannot run here ("" when they can)."""
    return _load()[1]


def isa() -> str:
    """The instruction set the loaded kernels were chosen for ("avx512", "avx2", "generic"); "" when
    unavailable. $RQ_CPU_ISA forces a lower one (e.g. "generic")."""
    lib = _load()[0]
    return "" if lib is None else lib.RqCpuIsa().decode()


def _require():
    if not available():
        raise NotImplementedError(f"native CPU kernels {unavailable_reason()}")


def _check_query(q, lengths):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, R, D], got {q.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"query dtype {q.dtype} (native kernels cover float32 and bfloat16)")
    if q.shape[3] > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {q.shape[3]} (native kernels cover up to {MAX_HEAD_DIM})")
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths must be [{q.shape[0]}], got {lengths.shape}")


def _partial_shapes(q):
    b, k, r, d = q.shape
    return (jax.ShapeDtypeStruct((b, k, r, d), jnp.float32), jax.ShapeDtypeStruct((b, k, r), jnp.float32),
            jax.ShapeDtypeStruct((b, k, r), jnp.float32))


def _empty(q):
    b, k, r, d = q.shape
    return (jnp.zeros((b, k, r, d), jnp.float32), jnp.full((b, k, r), NEG, jnp.float32),
            jnp.zeros((b, k, r), jnp.float32))


def _bits(x: jax.Array) -> jax.Array:
    """A narrow float array's bits as unsigned integers of its width (float32 as it is): the kernels read
    stored values by their bits, so a cache held as bits passes its own buffers (on XLA:CPU a bitcast-
    convert to a narrow float is a copy, and the round trip bits -> values -> bits folds away)."""
    if x.dtype == jnp.float32 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _check_table(lengths, block_table, stored_shape):
    """Raise ValueError unless `block_table` is an integer [B, N] (or None, with contiguous rows: the stored
    leaves [..., B, K, S] — a leaf's shape without its last axis — hold the B rows of `lengths`)."""
    b = lengths.shape[0]
    if block_table is None:
        if stored_shape[-3] != b:
            raise ValueError(f"contiguous rows: stored leaves {list(stored_shape)} hold {stored_shape[-3]} rows, "
                             f"q has {b} (a paged pool needs a block_table)")
    elif block_table.ndim != 2 or block_table.shape[0] != b or not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integer [{b}, N], got {block_table.dtype}{list(block_table.shape)}")


def _identity_table(lengths):
    return jnp.arange(lengths.shape[0], dtype=jnp.int32)[:, None]


def _call(target: str, q, lengths, slot, block_table, leaves, means=None, rotations=(), **attrs):
    """The FFI call `target`(q, lengths, slot, table, *leaves[, means], *rotations) -> (acc, m, l). Leaves are
    [..., B, K, S, ...] (contiguous, `block_table` None: the identity table is made here) or a pool [..., NP, K,
    P, ...]; rotations [..., K, D, D] (the leaves' slot axes first). On several devices it is partitioned over
    rows and kv heads as q is (`_partitioned`)."""
    lengths, slot = lengths.astype(jnp.int32), jnp.asarray(slot, jnp.int32).reshape(())
    table = None if block_table is None else block_table.astype(jnp.int32)
    ranks = tuple(x.ndim for x in leaves)

    def run(q, lengths, slot, table, leaves, means, rotations):
        table = _identity_table(lengths) if table is None else table
        call = jax.ffi.ffi_call(target, _partial_shapes(q), vmap_method="sequential")
        return tuple(call(q, lengths, slot, table, *leaves, *([] if means is None else [means]), *rotations,
                          **attrs))

    rotations = tuple(rotations)
    if jax.device_count() == 1:
        return run(q, lengths, slot, table, leaves, means, rotations)
    return _partitioned(run, ranks, table is not None, means is not None, len(rotations))(
        q, lengths, slot, table, leaves, means, rotations)


def _partitioned(run, ranks: tuple[int, ...], paged: bool, has_means: bool, num_rotations: int):
    """`run` as a custom-partitioned op: the factors b (rows) and k (kv heads) follow q's sharding, every
    other axis is whole on each device (slot axes, tokens, channels; a pool's pages; a rotation's rows)."""
    lead = ranks[0] - 4  # slot axes: the first leaf (codes, or dense K) has a channel axis, α leaves none
    operands = ["b k r d", "b", "", *(["b n"] if paged else [])]
    for i, rank in enumerate(ranks):  # [slot axes..., B or NP, K, S or P, (channels)]
        axes = [f"m{j}" for j in range(lead)] + ["np" if paged else "b", "k", "s"]
        operands.append(" ".join(axes + [f"c{i}"] * (rank - len(axes))))
    slots = " ".join(f"m{j}" for j in range(lead))
    operands += (["b k r l"] if has_means else []) + [f"{slots} k d e".strip()] * num_rotations
    factors = [f for op in operands for f in op.split()]
    whole = tuple(f for f in dict.fromkeys(factors) if f not in ("b", "k"))  # in the rule's order, as Shardy wants

    def unpack(rest):  # the op's operands after q, lengths and slot -> (table, leaves, means, rotations)
        table, rest = (rest[0], rest[1:]) if paged else (None, rest)
        leaves, rest = tuple(rest[: len(ranks)]), rest[len(ranks):]
        means, rest = (rest[0], rest[1:]) if has_means else (None, rest)
        return table, leaves, means, tuple(rest)

    def partition(mesh, arg_shapes, result_shape):
        b, k = (tuple(arg_shapes[0].sharding.spec) + (None, None))[:2]

        def spec(*axes):
            return NamedSharding(mesh, P(*axes))

        leaves = [spec(*[None] * lead, None if paged else b, k, *[None] * (r - lead - 2)) for r in ranks]
        args = (spec(b, k, None, None), spec(b), spec(), *([spec(b, None)] if paged else []), *leaves,
                *([spec(b, k, None, None)] if has_means else []),
                *[spec(*[None] * lead, k, None, None)] * num_rotations)
        outs = (spec(b, k, None, None), spec(b, k, None), spec(b, k, None))
        return mesh, lambda q, lengths, slot, *rest: run(q, lengths, slot, *unpack(rest)), outs, args

    op = custom_partitioning(lambda q, lengths, slot, *rest: run(q, lengths, slot, *unpack(rest)))
    op.def_partition(partition=partition, sharding_rule=", ".join(operands) + " -> b k r d, b k r, b k r",
                     need_replication_factors=whole)
    return lambda q, lengths, slot, table, leaves, means, rotations: op(
        q, lengths, slot, *([table] if paged else []), *leaves, *([means] if has_means else []), *rotations)


def _partitioned_encode(run, rank: int, has_mean: bool, channels: Sequence[int | None]):
    """`run` (z [..., K, L, B, T, D], num_new [B], mean) as a custom-partitioned op: the vectors' axes (all but
    L and D) keep whatever sharding z has, each device encoding its own vectors; loops and channels are whole on
    each device. `channels`: per result, 1 for [*lead, channels], 0 for [*lead], None for α's [rows, *lead],
    lead = [..., B, K, T]."""
    outer = [f"x{i}" for i in range(rank - 5)]
    dims = [*outer, "k", "l", "b", "t", "d"]  # z's axes
    lead = [*outer, "b", "k", "t"]
    operands = [" ".join(dims), "b"] + [" ".join(dims)] * has_mean
    results = [" ".join(["a", *lead] if extra is None else [*lead, *[f"c{i}"] * extra])
               for i, extra in enumerate(channels)]
    factors = [f for part in operands + results for f in part.split()]
    whole = tuple(f for f in dict.fromkeys(factors) if f not in dims or f in ("l", "d"))

    def op_fn(z, num_new, *mean):
        return run(z, num_new, mean[0] if mean else None)

    def partition(mesh, arg_shapes, result_shape):
        spec = dict(zip(dims, tuple(arg_shapes[0].sharding.spec) + (None,) * rank))
        spec["l"] = spec["d"] = None

        def named(part):
            return NamedSharding(mesh, P(*(spec.get(f) for f in part.split())))

        return mesh, op_fn, tuple(map(named, results)), tuple(map(named, operands))

    op = custom_partitioning(op_fn)
    op.def_partition(partition=partition, sharding_rule=", ".join(operands) + " -> " + ", ".join(results),
                     need_replication_factors=whole)
    return lambda z, num_new, mean: op(z, num_new, *([] if mean is None else [mean]))


def dense_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, slot: jax.Array | int,
                           block_table: jax.Array | None = None, **launch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial of q [B, K, R, D] (float32 | bfloat16) over a slot's stored keys and
    values k = v [M, B, K, S, D] (bfloat16 | float32; with `block_table` [B, N] a pool [M, NP, K, P, D]) at
    s < lengths[b] [B] int32; `slot` [] picks one of the M stacked slots. Returns acc [B, K, R, D], m, l
    [B, K, R] (float32). Launch keywords of the Pallas kernel (`block_s`, ...) are accepted and ignored."""
    del launch
    _check_query(q, lengths)
    if k.ndim < 5 or v.shape != k.shape or k.shape[-3] != q.shape[1] or k.shape[-1] != q.shape[3]:
        raise ValueError(f"want k = v [M, B, K, S, D] for q {q.shape}; got {k.shape}, {v.shape}")
    if k.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != k.dtype:
        raise NotImplementedError(f"cache dtypes {k.dtype}/{v.dtype} (native kernel covers bfloat16 and float32)")
    _check_table(lengths, block_table, k.shape[:-1])
    _require()
    if k.shape[-2] == 0:
        return _empty(q)
    return _call("rq_cpu_dense", q, lengths, slot, block_table, (_bits(k), _bits(v)))


def _links(streams, bits, groups, dim: int, what: str) -> tuple[tuple[int, int], ...]:
    """(bits, group size) per link from the arrays' shapes, checked against `bits`/`groups` when given."""
    if not 1 <= len(streams) <= MAX_LINKS:
        raise NotImplementedError(f"{what}: chains of 1 to {MAX_LINKS} links, got {len(streams)}")
    out = []
    for i, st in enumerate(streams):
        nbytes, ngroups = st.codes.shape[-1], st.scale.shape[-1]
        b = 8 * nbytes // dim if bits is None else int(bits[i])
        if b not in SUPPORTED_BITS:
            raise NotImplementedError(f"{what} link {i}: {b}-bit codes (native kernel covers {SUPPORTED_BITS})")
        if st.codes.dtype != jnp.uint8 or nbytes * 8 != dim * b:
            raise ValueError(f"{what} link {i}: codes {st.codes.dtype}{list(st.codes.shape)} for {b}-bit D={dim}")
        if dim % (8 // b):
            raise NotImplementedError(f"{what} link {i}: head dim {dim} does not split into {8 // b} planes")
        g = dim // max(ngroups, 1) if groups is None else int(groups[i])
        if ngroups == 0 or g * ngroups != dim:
            raise ValueError(f"{what} link {i}: {ngroups} metadata groups of {g} for head dim {dim}")
        if st.scale.dtype not in [jnp.dtype(t) for t in SUPPORTED_META] or st.offset.dtype != st.scale.dtype:
            raise NotImplementedError(f"{what} link {i}: metadata dtypes {st.scale.dtype}/{st.offset.dtype}")
        if st.offset.shape != st.scale.shape or st.scale.shape[:-1] != st.codes.shape[:-1]:
            raise ValueError(f"{what} link {i}: codes {st.codes.shape}, scale {st.scale.shape}, "
                             f"offset {st.offset.shape} disagree")
        out.append((b, g))
    return tuple(out)


def residual_decode_attention(
    q: jax.Array,                             # [B, K, R, D] float32 | bfloat16, rotated key basis
    keys: Sequence,                           # chain links (codes, scale, offset), loop first, anchor last
    values: Sequence,                         # the same chain for values
    k_alpha: Sequence[jax.Array | None],      # len(keys) - 1 entries: [M, B, K, S] bf16, or None (α = 1)
    v_alpha: Sequence[jax.Array | None],      # len(values) - 1 entries
    mean_scores: Sequence[jax.Array | None] | None,  # per key link: q·μ_i [B, K, R] float32, or None
    lengths: jax.Array,                       # [B] int32 valid stored tokens per row
    slot: jax.Array | int,                    # [] int32: which of the M stacked slots
    block_table: jax.Array | None = None,     # [B, N] int32 page of each row's logical page; None: contiguous
    *,
    k_bits: tuple[int, ...] | None = None,
    v_bits: tuple[int, ...] | None = None,
    k_group_sizes: tuple[int, ...] | None = None,
    v_group_sizes: tuple[int, ...] | None = None,
    key_rot: jax.Array | None = None,         # [M, K, D, D] float32 (z = U x), with value_rot, or neither
    value_rot: jax.Array | None = None,
    **launch,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention partial of rotated queries over a slot's packed stored tokens, the
    signature of `pallas_kernels.residual_decode_attention_reference` plus a block table: codes uint8
    [M, B, K, S, D·bits/8] (planar packing, bits 1/2/4/8), scale/offset [M, B, K, S, D/g] (float8_e4m3fn,
    bfloat16, float16 or float32; any g dividing D, per link), α bf16 (with `block_table` [B, N]: a pool of
    pages, B → NP and S → P in every leaf). Returns acc [B, K, R, D] (rotated value basis), m, l [B, K, R],
    float32. Given `key_rot` and `value_rot` [M, K, D, D] (stacked over the links' slot axes, `slot` picking
    one, so that a stacked calibration is read where it lies), the kernel rotates itself: q comes in the
    original basis (each row rotated, q̃ = U_k q) and acc goes back to it (acc·U_v); `mean_scores` are still
    q̃·μ_i. Launch keywords of the Pallas kernel are accepted and ignored."""
    del launch
    keys, values, k_alpha, v_alpha = tuple(keys), tuple(values), tuple(k_alpha), tuple(v_alpha)
    _check_query(q, lengths)
    d = q.shape[3]
    k_links = _links(keys, k_bits, k_group_sizes, d, "keys")
    v_links = _links(values, v_bits, v_group_sizes, d, "values")
    for name, alphas, chain in (("k_alpha", k_alpha, keys), ("v_alpha", v_alpha, values)):
        if len(alphas) != len(chain) - 1:
            raise ValueError(f"{name}: {len(alphas)} entries for a chain of {len(chain)} links")
        for a in alphas:
            if a is not None and (a.dtype != jnp.bfloat16 or a.shape != chain[0].codes.shape[:-1]):
                raise NotImplementedError(f"{name}: {a.dtype}{list(a.shape)} (native kernel reads bf16 [M, B, K, S])")
    lead = keys[0].codes.shape[:-1]
    if len(lead) < 4 or lead[-2] != q.shape[1] or any(st.codes.shape[:-1] != lead for st in (*keys, *values)):
        raise ValueError(f"every link must share [M, B, K, S] with K = {q.shape[1]}; got {lead}")
    if mean_scores is not None and len(mean_scores) != len(keys):
        raise ValueError(f"mean_scores: {len(mean_scores)} entries for a chain of {len(keys)} links")
    if (key_rot is None) != (value_rot is None):
        raise ValueError("key_rot and value_rot come together (or neither)")
    rotations = () if key_rot is None else (key_rot, value_rot)
    want = (*lead[:-3], q.shape[1], d, d)  # the links' slot axes, then [K, D, D]
    for u in rotations:
        if u.dtype != jnp.float32 or u.shape != want:
            raise ValueError(f"rotations must be float32 {list(want)} (the links' slot axes, then [K, D, D]), "
                             f"got {u.dtype}{list(u.shape)}")
    _check_table(lengths, block_table, lead)
    _require()
    if lead[-1] == 0:
        return _empty(q)
    leaves = []
    for streams, alphas in ((keys, k_alpha), (values, v_alpha)):
        for st in streams:
            leaves += [st.codes, _bits(st.scale), _bits(st.offset)]
        leaves += [_bits(a) for a in alphas if a is not None]
    means = None
    if mean_scores is not None and any(mu is not None for mu in mean_scores):
        means = jnp.stack([jnp.zeros(q.shape[:3], jnp.float32) if mu is None else mu.astype(jnp.float32)
                           for mu in mean_scores], axis=-1)
    flags = lambda alphas: np.array([a is not None for a in alphas], np.int64)  # noqa: E731
    return _call("rq_cpu_quant", q, lengths, slot, block_table, tuple(leaves), means, rotations,
                 k_bits=np.array([b for b, _ in k_links], np.int64),
                 k_groups=np.array([g for _, g in k_links], np.int64),
                 v_bits=np.array([b for b, _ in v_links], np.int64),
                 v_groups=np.array([g for _, g in v_links], np.int64),
                 k_alpha=flags(k_alpha), v_alpha=flags(v_alpha),
                 k_meta=np.array([_META_CODE[st.scale.dtype] for st in keys], np.int64),
                 v_meta=np.array([_META_CODE[st.scale.dtype] for st in values], np.int64),
                 has_means=np.int64(means is not None), has_rotations=np.int64(bool(rotations)))


ENCODE_BITS = (0, 1, 2, 4, 8)
#: The encoder's metadata dtypes, by the code kernels.h names them.
_ENCODE_META = {jnp.dtype(jnp.float8_e4m3fn): 3, jnp.dtype(jnp.bfloat16): 1}


def residual_encode(
    z: jax.Array,                   # [..., K, L, B, T, D] float32: a loop group of rotated K or V vectors
    mean: jax.Array | None = None,  # z's shape, float32: per-loop key means (None: none)
    num_new: jax.Array | None = None,  # [B] int32: each row's tokens t < num_new[b] are coded (None: all T)
    *,
    bits: Sequence[int],            # per loop: 0 (nothing stored), 1, 2, 4 or 8
    group_sizes: Sequence[int],     # per loop: channels per scale/offset
    clips: Sequence[float],         # per loop: the clip factor of the range (0.9 at 2 bits, else 1)
    parents: Sequence[int],         # per loop: the loop it is a residual of (-1: the anchor, or coded alone)
    order: Sequence[int],           # the loops in encode order (each parent before its children)
    least_squares: bool,            # residuals against α-scaled references (α stored per vector)
    meta_dtype,                     # float8_e4m3fn or bfloat16
) -> tuple[tuple[tuple[jax.Array, jax.Array, jax.Array], ...], jax.Array | None, jax.Array]:
    """ResidualQuant's encoder of one loop group, natively: the same bits as rq_jax's XLA encoder
    (`rq_jax.quant.residual.encode_decode_group`, `affine.quantize`, `packing.pack`; src/encode.cc gives the
    arithmetic). z is laid out as the rotation's dot product gives it (per kv head K, the L loops, then rows B
    and tokens T), and every result by vector in the cache's order, lead = [..., B, K, T]: nothing is
    transposed on the way. The results of a row's tokens past num_new[b] (a call's padding) are zeros. Returns
    per loop (codes uint8 [*lead, D·bits/8] planar-packed, scale and offset [*lead, D/g] in `meta_dtype`;
    [*lead, 0] at 0 bits), α [L', *lead] bfloat16 (one row per loop with a parent, in loop order; None without
    least squares) and the values no field could hold, per vector [*lead] int32. Raises NotImplementedError
    for what it does not cover (other widths or metadata dtypes, D > 512, more than 8 loops) and ValueError for
    shapes that disagree."""
    if z.ndim < 5:
        raise ValueError(f"z must be [..., K, L, B, T, D], got shape {z.shape}")
    n, d = z.shape[-4], z.shape[-1]
    if not all(len(x) == n for x in (bits, group_sizes, clips, parents, order)):
        raise ValueError(f"z holds {n} loops; bits, group_sizes, clips, parents and order need one entry each")
    if mean is not None and mean.shape != z.shape:
        raise ValueError(f"mean must have z's shape {z.shape}, got {mean.shape}")
    meta = jnp.dtype(meta_dtype)
    if meta not in _ENCODE_META:
        raise NotImplementedError(f"metadata dtype {meta} (the native encoder covers float8_e4m3fn and bfloat16)")
    if n > MAX_LINKS or d > MAX_HEAD_DIM:
        raise NotImplementedError(f"{n} loops of head dim {d} (native encoder: up to {MAX_LINKS} loops, D <= 512)")
    for b, g in zip(bits, group_sizes):
        if b not in ENCODE_BITS:
            raise NotImplementedError(f"{b}-bit codes (the native encoder covers {ENCODE_BITS})")
        if b and (d % g or d % (8 // b)):
            raise ValueError(f"{b}-bit codes in groups of {g} do not divide head dim {d}")
    _require()
    alpha_rows = [sum(1 for q in range(r) if parents[q] >= 0) if parents[r] >= 0 else -1 for r in range(n)]
    has_alpha = least_squares and any(r >= 0 for r in alpha_rows)
    meta_bits = jnp.dtype(f"uint{8 * meta.itemsize}")

    def out_shapes(lead):  # per stored loop codes, scale, offset; α; lost — rows of vectors [*lead]
        shapes = []
        for b, g in zip(bits, group_sizes):
            if b:
                shapes += [jax.ShapeDtypeStruct(lead + (d * b // 8,), jnp.uint8),
                           *[jax.ShapeDtypeStruct(lead + (d // g,), meta_bits)] * 2]
        if has_alpha:
            shapes.append(jax.ShapeDtypeStruct((sum(r >= 0 for r in alpha_rows),) + lead, jnp.uint16))
        return shapes + [jax.ShapeDtypeStruct(lead, jnp.int32)]

    attrs = dict(bits=np.array(bits, np.int64), groups=np.array(group_sizes, np.int64),
                 clips=np.array(clips, np.float32), parents=np.array(parents, np.int64),
                 alpha_rows=np.array(alpha_rows, np.int64), order=np.array(order, np.int64),
                 meta=np.int64(_ENCODE_META[meta]), least_squares=np.int64(has_alpha))

    def vectors(shape):  # z's [..., K, L, B, T, D] → the results' [..., B, K, T]
        return (*shape[:-5], shape[-3], shape[-5], shape[-2])

    def run(z, num_new, mean):  # z and mean as [O, K, L, B, T, D]: the same bytes
        six = [x.astype(jnp.float32).reshape(-1, *z.shape[-5:]) for x in (z, *([] if mean is None else [mean]))]
        return tuple(jax.ffi.ffi_call("rq_cpu_encode", out_shapes(vectors(z.shape)), vmap_method="sequential")(
            six[0], num_new.astype(jnp.int32), *six[1:], **attrs))

    lead = vectors(z.shape)
    if num_new is None:
        num_new = jnp.full(z.shape[-3], z.shape[-2], jnp.int32)
    if num_new.shape != (z.shape[-3],):
        raise ValueError(f"num_new must be [B] = [{z.shape[-3]}] for z {z.shape}, got {num_new.shape}")
    if jax.device_count() == 1:
        out = list(run(z, num_new, mean))
    else:
        channels = [1] * 3 * sum(b > 0 for b in bits) + [None] * has_alpha + [0]
        out = list(_partitioned_encode(run, z.ndim, mean is not None, channels)(z, num_new, mean))
    lost = out.pop()
    alpha = jax.lax.bitcast_convert_type(out.pop(), jnp.bfloat16) if has_alpha else None
    loops, it = [], iter(out)
    for b in bits:
        if b:
            codes, scale, offset = next(it), next(it), next(it)
            loops.append((codes, jax.lax.bitcast_convert_type(scale, meta), jax.lax.bitcast_convert_type(offset, meta)))
        else:
            empty = jnp.zeros(lead + (0,), meta)
            loops.append((jnp.zeros(lead + (0,), jnp.uint8), empty, empty))
    return tuple(loops), alpha, lost


def store_tokens(pool: Sequence[jax.Array], new: Sequence[jax.Array], lengths: jax.Array, num_new: jax.Array,
                 block_table: jax.Array) -> list[jax.Array]:
    """Every leaf of `new` [G, N, B, K, T, ...] stored in its leaf of the paged `pool` [G, N, NP, K, P, ...]
    (rq_jax's layout; the same other axes, any dtype, copied as its bytes) in one FFI call that updates the
    pool's buffers in place (aliased, so a donated pool is not copied): token t < num_new[b] of row b lands
    at position lengths[b] + t, in page block_table[b, pos // P] at offset pos % P; positions before 0 or past
    the table's N pages are dropped. Returns the new pool leaves. A page the tokens land in must lie in the
    pool (else the call fails naming it). lengths, num_new [B] and block_table [B, N] are integers. On several
    devices it raises NotImplementedError (the pool's sharding is the caller's: use XLA's write)."""
    if len(pool) != len(new):
        raise ValueError(f"{len(pool)} pool leaves for {len(new)} new ones")
    b = lengths.shape[0]
    if num_new.shape != (b,) or block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"want lengths, num_new [B] and block_table [B, N]; got {lengths.shape}, {num_new.shape}, "
                         f"{block_table.shape}")
    for x, y in zip(pool, new):
        if x.ndim < 5 or y.ndim != x.ndim or y.shape[2] != b or y.shape[:2] + y.shape[3:4] + y.shape[5:] != \
                x.shape[:2] + x.shape[3:4] + x.shape[5:]:
            raise ValueError(f"new leaf {y.shape} does not fit pool leaf {x.shape} ([G, N, B, K, T, ...] into "
                             f"[G, N, NP, K, P, ...], B = {b})")
    if jax.device_count() > 1:
        raise NotImplementedError("a pool on several devices")
    _require()
    if not pool:
        return []
    bits = [_bits(x) for x in pool]
    n = len(bits)
    call = jax.ffi.ffi_call("rq_cpu_store", [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in bits],
                            input_output_aliases={3 + n + i: i for i in range(n)}, vmap_method="sequential")
    out = call(lengths.astype(jnp.int32), num_new.astype(jnp.int32), block_table.astype(jnp.int32),
               *(_bits(y.astype(x.dtype)) for x, y in zip(pool, new)), *bits)
    return [o if o.dtype == x.dtype else jax.lax.bitcast_convert_type(o, x.dtype) for o, x in zip(out, pool)]


__all__ = ["available", "dense_decode_attention", "isa", "residual_decode_attention", "residual_encode",
           "store_tokens", "unavailable_reason"]
