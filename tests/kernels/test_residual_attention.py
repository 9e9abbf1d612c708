"""`residual_decode_attention` (packed ResidualQuant chains) against its jnp reference, and its lowering."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import residual_attention as ra

from ._base import DecodeKernelTestBase, allocated_configs, array, normal, random_bytes, seeded, uniform


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration. `k_links`/`v_links`: (bits, group size) per chain link, loop first, anchor
    last (v_links None: as keys). Batch = len(lengths); S stored positions; the last of `slots` slots."""

    name: str
    dim: int
    rows: int
    k_links: tuple
    v_links: tuple | None = None
    lengths: tuple = (37, 0)
    s: int = 100
    heads: int = 2
    slots: int = 2
    q_dtype: str = "float32"
    meta: str = "float8_e4m3fn"
    alpha: bool = True
    means: tuple | None = None  # per key link: whether it has a key-mean score
    block_s: int | None = None
    num_splits: int | None = None
    dequant_keys: bool | None = None  # the key path; None: the launch table's


def _stream(rng, lead, dim, bits, group, meta):
    return ra.QuantStream(
        array(rng, lead + (dim * bits // 8,), "uint8", random_bytes),
        array(rng, lead + (dim // group,), meta, uniform(0.02, 0.3)),
        array(rng, lead + (dim // group,), meta, normal(0.5)))


def make_inputs(case: Case, rng):
    """(args, kwargs) of `residual_decode_attention` for `case` (ShapeDtypeStructs when rng is None)."""
    b = len(case.lengths)
    lead = (case.slots, b, case.heads, case.s)
    v_links = case.v_links or case.k_links
    keys = tuple(_stream(rng, lead, case.dim, bits, g, case.meta) for bits, g in case.k_links)
    values = tuple(_stream(rng, lead, case.dim, bits, g, case.meta) for bits, g in v_links)
    alpha = lambda: array(rng, lead, "bfloat16", uniform(0.3, 1.2)) if case.alpha else None  # noqa: E731
    k_alpha = tuple(alpha() for _ in keys[1:])
    v_alpha = tuple(alpha() for _ in values[1:])
    means = None if case.means is None else tuple(
        array(rng, (b, case.heads, case.rows), "float32", normal()) if has else None for has in case.means)
    q = array(rng, (b, case.heads, case.rows, case.dim), case.q_dtype, normal(1.5))
    lengths = array(rng, (b,), "int32", lambda r, s: np.asarray(case.lengths))
    slot = array(rng, (), "int32", lambda r, s: np.asarray(case.slots - 1))
    kw = dict(k_bits=tuple(x for x, _ in case.k_links), v_bits=tuple(x for x, _ in v_links),
              k_group_sizes=tuple(g for _, g in case.k_links), v_group_sizes=tuple(g for _, g in v_links),
              block_s=case.block_s, num_splits=case.num_splits, dequant_keys=case.dequant_keys)
    return (q, keys, values, k_alpha, v_alpha, means, lengths, slot), kw


ANCHOR = ((4, 32),)               # the INT4 anchor alone (the anchor loop's chain)
LOOP_G32 = ((2, 32), (4, 32))     # a residual loop over the anchor, g = 32 (Ouro's [2,2,2,4])
LOOP_G16 = ((2, 16), (4, 32))     # INT2 g = 16 residual, INT4 g = 32 anchor

CASES = (
    # Ouro's residual loop: ragged batch with an empty row, S not a multiple of the tile, two splits.
    Case("d128-loop-g32-f32q", 128, 1, LOOP_G32, num_splits=2),
    # The anchor loop alone; GQA rows; length 1 next to a full row; bf16 queries; default plan.
    Case("d128-anchor-gqa-bf16q", 128, 4, ANCHOR, lengths=(1, 100), q_dtype="bfloat16"),
    # Huginn's head dim: 24-channel planes straddle 16-channel groups; bf16 metadata; key means.
    Case("d96-loop-g16-means", 96, 3, LOOP_G16, lengths=(50, 7), meta="bfloat16", means=(True, True),
         block_s=16, num_splits=3),
    # `uniform`/`rotated` INT2 (one stream) at head dim 96, bf16 queries.
    Case("d96-uniform-bf16q", 96, 1, ((2, 32),), lengths=(0, 33), q_dtype="bfloat16"),
    # Head dim 64, INT2 g = 32: one group spans two 16-byte planes; keys and values with different links.
    Case("d64-g32-straddle", 64, 2, LOOP_G32, v_links=LOOP_G16, lengths=(64, 17), num_splits=2),
    # GQA with 8 rows, a key mean on the residual link only, bf16 queries.
    Case("d64-gqa-mean-bf16q", 64, 8, LOOP_G16, lengths=(1, 90), q_dtype="bfloat16", means=(True, False)),
    # 8-bit codes, float32 metadata, no α (α = 1).
    Case("d128-int8-f32meta-noalpha", 128, 1, ((8, 32), (4, 32)), meta="float32", alpha=False,
         lengths=(100, 3)),
    # A three-link chain (previous-loop reference: loop -> parent -> anchor).
    Case("d64-chain3", 64, 1, ((2, 16), (2, 16), (4, 32)), lengths=(45, 0), block_s=16, num_splits=2),
    # More query rows than one row block (two programs along rows).
    Case("d64-rows80", 64, 80, ((2, 32),), lengths=(20, 0), s=40),
    # Keys and values with different links: INT2 keys beside INT4 values over INT4 anchors.
    Case("d64-kv-split-int4-values", 64, 1, LOOP_G32, v_links=((4, 32), (4, 32)), lengths=(33, 100)),
    # The reconstructed-key path (`dequant_keys`): straddling planes with key means on every link; a
    # three-link chain with a mean on two links; four g16 links, bf16 queries and no α.
    Case("d96-loop-g16-means-dequant", 96, 3, LOOP_G16, lengths=(50, 7), meta="bfloat16", means=(True, True),
         block_s=16, num_splits=3, dequant_keys=True),
    Case("d64-chain3-means-dequant", 64, 2, ((2, 16), (2, 16), (4, 32)), lengths=(45, 0), means=(True, False, True),
         block_s=16, num_splits=2, dequant_keys=True),
    Case("d128-chain4-g16-bf16q-noalpha-dequant", 128, 1, ((2, 16),) * 3 + ((4, 16),), lengths=(1, 100),
         q_dtype="bfloat16", alpha=False, dequant_keys=True),
    # The launch table's reconstructed-key g32 class: a 4-link g32 chain at D64, key means on every link.
    Case("d64-chain4-g32-means-dequant", 64, 1, ((2, 32),) * 3 + ((4, 32),), lengths=(16, 61), means=(True,) * 4,
         num_splits=2),
)


#: The chains of the schedules the bit allocator emitted (docs/results/allocation), keys and values apart, with
#: the launch the dispatch picks for them (issue 28: the emitted schedules run through the kernel): the calls
#: that cover every link and chain length (`_base.covering`), all of them with RQ_KERNEL_COMPILE=all.
ALLOCATED_CASES = tuple(Case(f"allocated-{name}", 64, 1, cfg.links, v_links=cfg.v_links, lengths=(70, 9),
                             num_splits=2) for name, cfg in sorted(allocated_configs().items()))


def _lower_cases():
    out = []
    for dim, links, q_dtype in itertools.product((64, 96, 128), (ANCHOR, LOOP_G32, LOOP_G16, ((2, 16),)),
                                                 ("float32", "bfloat16")):
        name = f"d{dim}-" + "-".join(f"int{b}g{g}" for b, g in links) + f"-{q_dtype}q"
        out.append(Case(name, dim, 1 if dim != 64 else 4, links, q_dtype=q_dtype, s=4096, heads=16,
                        lengths=(4096, 1000)))
    out += [
        Case("d128-loop-g32-means-bf16meta", 128, 1, LOOP_G32, meta="bfloat16", means=(True, True)),
        Case("d128-int8-f32meta-noalpha", 128, 1, ((8, 32), (4, 32)), meta="float32", alpha=False),
        Case("d96-chain3", 96, 1, ((2, 16), (2, 16), (4, 32))),
        Case("d128-chain4-g16-means-dequant", 128, 1, ((2, 16),) * 3 + ((4, 16),), means=(True,) * 4,
             dequant_keys=True),
        Case("d96-rows80", 96, 80, LOOP_G16),
        Case("d64-block128-splits1", 64, 1, LOOP_G32, block_s=128, num_splits=1, s=1024),
    ]
    return tuple(out)


class TestResidualDecodeAttention(DecodeKernelTestBase):
    CASES = CASES + ALLOCATED_CASES
    LOWER_CASES = _lower_cases()
    #: Ouro's loop in 16-token pages (a tile per page); Huginn's straddling planes, bf16 metadata and key
    #: means on the reconstructed-key path, 32-token tiles across 48-token pages (per-token pages); the anchor
    #: in one 64-token page per row.
    PAGED_CASES = ((Case("d128-loop-g32-paged", 128, 1, LOOP_G32, lengths=(37, 0, 160), s=192), 16),
                   (Case("d96-loop-g16-means-paged", 96, 3, LOOP_G16, lengths=(50, 96), s=96, meta="bfloat16",
                         means=(True, True), block_s=32, dequant_keys=True), 48),
                   (Case("d64-anchor-paged-bf16q", 64, 1, ANCHOR, lengths=(64, 63), s=64, q_dtype="bfloat16"), 64))
    CACHE_ARGS = slice(1, 5)
    SKIP_CASE = Case("skip", 64, 2, LOOP_G32, lengths=(0, 1, 16, 17, 33), s=96, block_s=16, num_splits=2)
    kernel = staticmethod(ra.residual_decode_attention)
    reference = staticmethod(ra.residual_decode_attention_reference)

    def make(self, case, rng):
        return make_inputs(case, rng)


def test_reference_matches_explicit_dequantization():
    """The reference's planar unpacking: byte j's plane k is channel j + kJ, least significant first."""
    codes = jnp.asarray(np.array([[0b11100100, 0b00011011]], np.uint8))  # J = 2 bytes, D = 8 channels
    np.testing.assert_array_equal(ra.unpack_planar(codes, 2), [[0, 3, 1, 2, 2, 1, 3, 0]])
    np.testing.assert_array_equal(ra.unpack_planar(codes, 4), [[4, 11, 14, 1]])


def test_shapes_infer_bits_and_groups():
    """Without k_bits/… the kernel reads bits and group sizes from the shapes, with the same result."""
    case = Case("infer", 96, 3, LOOP_G16, s=40, lengths=(40, 5), block_s=16)
    args, kw = make_inputs(case, seeded(case.name))
    explicit = ra.residual_decode_attention_reference(*args, **kw)
    inferred = ra.residual_decode_attention_reference(*args)
    for a, b in zip(explicit, inferred):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        ra.residual_decode_attention(*args, **{**kw, "k_bits": (4, 4)})


@pytest.mark.parametrize("change, why", [
    (dict(k_links=((3, 32),)), "3-bit"),
    (dict(k_links=((2, 8),)), "group size 8"),
    (dict(dim=272, k_links=((2, 16),)), "head dim 272"),
])
def test_unsupported_configurations_raise(change, why):
    case = dataclasses.replace(Case("unsupported", 64, 1, ((2, 16),), s=32), **change)
    lead = (case.slots, 2, case.heads, case.s)
    bits, g = case.k_links[0]
    stream = ra.QuantStream(jnp.zeros(lead + (case.dim * bits // 8,), jnp.uint8),
                            jnp.zeros(lead + (case.dim // g,), jnp.float8_e4m3fn),
                            jnp.zeros(lead + (case.dim // g,), jnp.float8_e4m3fn))
    q = jnp.zeros((2, case.heads, 1, case.dim), jnp.float32)
    with pytest.raises(NotImplementedError):
        ra.residual_decode_attention(q, (stream,), (stream,), (), (), None, jnp.zeros(2, jnp.int32), 0,
                                     k_bits=(bits,), v_bits=(bits,), k_group_sizes=(g,), v_group_sizes=(g,))


def test_float16_queries_raise():
    args, kw = make_inputs(Case("f16", 64, 1, ANCHOR, s=32), seeded("f16"))
    with pytest.raises(NotImplementedError):
        ra.residual_decode_attention(args[0].astype(jnp.float16), *args[1:], **kw)


@pytest.mark.parametrize("bits, group", [(2, 16), (2, 32), (4, 32), (8, 32)])
def test_layout_matches_rq_jax_packing(bits, group):
    """The kernels' reading of the packed layout agrees with rq_jax's writer (pack + affine metadata)."""
    from rq_jax.quant import affine
    from rq_jax.quant.packing import PackedCodes

    rng = seeded(f"layout{bits}{group}")
    x = jnp.asarray(rng.standard_normal((1, 2, 3, 5, 96)).astype(np.float32))  # [M, B, K, S, D]
    cfg = affine.QuantConfig(bits, group)
    packed = PackedCodes.from_quantized(affine.quantize(x, cfg), cfg)
    stream = ra.QuantStream(packed.codes, packed.scale, packed.offset)
    np.testing.assert_array_equal(np.asarray(ra.dequantize(stream, bits, 0)), np.asarray(packed.dequantize()[0]))
