"""The TPU (Mosaic) packed-chain decode kernel: TPU interpret mode against its jnp reference, its coverage of
the shipped chains, and real compiles for v5e and v6e through libtpu (skipped where `jax[tpu]` is missing).

Interpret mode (`pltpu.InterpretParams`) simulates HBM, VMEM, the pipeline's DMAs and two TensorCores on the
CPU with the race detector on. Every position a row must not read (past its length, on pages no row's valid
prefix uses, in the other slot) holds NaN metadata and α (FP8 NaN bits decode to 480 in the kernel: a wrong
mask still shows) and random codes, so a mask, page, head or slot mistake shows as a non-finite or wrong output.

Tolerances (`_base.TOL`, of the largest |output|), as for the GPU kernel (`_base`'s docstring): codes are
exact, FP8/bf16 metadata and α exact in float32, the reconstructed key/value tiles and p enter bf16 dots as
hi + lo (~2^-16 relative, lo·lo dropped), float32 queries too (bf16 queries are exact); accumulation is
float32 in another order than the reference's HIGHEST-precision einsums (~D·2^-24). Measured on these cases:
at most 1.1e-5 of the largest |output| with float32 queries, 6e-6 with bf16 queries; the bounds (2e-4,
1e-4) keep a >= 15x margin and still catch a wrong α, offset, key mean, plane or page (a 1% change of one
value link's offset moves acc by ~1e-3 of its scale).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import configs
from pallas_kernels import tpu_deviceless as td
from pallas_kernels import tpu_launch
from pallas_kernels import tpu_residual_attention as tra

from ._base import TOL, allocated_configs, assert_partial_close, paged_case, seeded
from .test_tpu_attention import interpret, races_found

PAPER = ((2, 32),) * 3 + ((4, 32),)  # Ouro's [2,2,2,4] g32 reference chain


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: `k_links`/`v_links` (bits, group size) per link, loop first (v_links None: as keys); batch
    = len(lengths); S stored positions in pages of `page` tokens; slot 1 of 2. `paged`: the serving engine's
    pool (`_base.paged_case`: each row's pages placed at random among twice as many, the others poisoned,
    table entries past a row's pages -1 or past the pool), else contiguous with `page` as block_s. `means`:
    per key link, whether it has a key-mean score."""

    name: str
    dim: int
    rows: int
    k_links: tuple
    lengths: tuple
    s: int
    page: int
    v_links: tuple | None = None
    heads: int = 2
    q_dtype: str = "float32"
    meta: str = "float8_e4m3fn"
    alpha: bool = True
    means: tuple | None = None
    paged: bool = False


def make_inputs(case: Case, rng: np.random.Generator):
    """(args, kwargs) of `tpu_residual_decode_attention` for `case`, every unread position poisoned."""
    b, kh, s = len(case.lengths), case.heads, case.s
    lengths = np.asarray(case.lengths, np.int32)
    read = np.zeros((2, b, 1, s), bool)
    read[1] = (np.arange(s)[None, :] < lengths[:, None])[:, None, :]

    def poisoned(x, dtype):  # [2, B, K, S, ...] float -> dtype, NaN where unread
        mask = read.reshape(read.shape + (1,) * (x.ndim - 4))
        return jnp.asarray(np.where(mask, x, np.nan), dtype)

    def stream(bits, g):
        lead = (2, b, kh, s)
        return tra.QuantStream(jnp.asarray(rng.integers(0, 256, lead + (case.dim * bits // 8,), dtype=np.uint8)),
                               poisoned(rng.uniform(0.02, 0.3, lead + (case.dim // g,)), case.meta),
                               poisoned(0.5 * rng.standard_normal(lead + (case.dim // g,)), case.meta))

    v_links = case.v_links or case.k_links
    keys, values = tuple(stream(*ln) for ln in case.k_links), tuple(stream(*ln) for ln in v_links)

    def alphas(links):
        return tuple(poisoned(rng.uniform(0.3, 1.2, (2, b, kh, s)), jnp.bfloat16) if case.alpha else None
                     for _ in links[1:])

    means = None if case.means is None else tuple(
        jnp.asarray(rng.standard_normal((b, kh, case.rows)), jnp.float32) if has else None for has in case.means)
    q = jnp.asarray(1.5 * rng.standard_normal((b, kh, case.rows, case.dim)), case.q_dtype)
    cache, table = (keys, values, alphas(case.k_links), alphas(v_links)), None
    if case.paged:
        cache, table = paged_case(cache, case.lengths, case.page, case.name)
    args = (q, *cache, means, jnp.asarray(lengths), jnp.int32(1), table)
    kw = dict(k_bits=tuple(x for x, _ in case.k_links), v_bits=tuple(x for x, _ in v_links),
              k_group_sizes=tuple(g for _, g in case.k_links), v_group_sizes=tuple(g for _, g in v_links))
    return args, kw


CASES = (
    # The paper's chain: lengths 0, 1, page - 1, page, page + 1 and max_len, two heads per step.
    Case("paper-d128-fp8-ragged", 128, 1, PAPER, (0, 1, 127, 128, 129, 256), 256, 128),
    # Residual INT2 g32 over INT4: GQA 4 rows, bf16 queries, key means, a permuted block table.
    Case("residual-int2g32-d64-gqa4-bf16q-paged", 64, 4, ((2, 32), (4, 32)), (200, 0, 256, 129), 256, 128,
         q_dtype="bfloat16", means=(True, True), paged=True),
    # `rotated` INT2 (one link), bf16 metadata, the whole of S = 40 as one page.
    Case("rotated-int2g32-d128-bf16meta", 128, 1, ((2, 32),), (40, 17, 0), 40, 40, meta="bfloat16"),
    # float16 metadata (its uint16 bits, decoded in the kernel), paged, GQA 2.
    Case("residual-int2g32-d64-f16meta-paged", 64, 2, ((2, 32), (4, 32)), (100, 256, 1), 256, 128, meta="float16",
         paged=True),
    # `uniform` INT4 at Huginn's head dim (48-byte rows, 3 groups), float32 metadata, a key mean.
    Case("uniform-int4g32-d96-f32meta-mean", 96, 2, ((4, 32),), (1, 100), 100, 100, meta="float32", means=(True,)),
    # A three-link g16 chain at head dim 96 (24-byte INT2 planes), means on two links, paged, GQA 3.
    Case("chain3-g16-d96-means-paged", 96, 3, ((2, 16), (2, 16), (4, 32)), (130, 256, 1), 256, 128,
         means=(True, False, True), paged=True),
    # 1-bit and 8-bit codes, keys and values with different links, float32 metadata, no α.
    Case("int1-int8-d64-f32meta-noalpha", 64, 1, ((1, 32), (8, 16)), (57, 3), 64, 64, v_links=((8, 32), (1, 16)),
         meta="float32", alpha=False),
    # A partial last block: S = 200 in blocks of 128 (the edge block padded by Mosaic).
    Case("paper-d64-edge-bf16q", 64, 2, PAPER, (200, 128, 0), 200, 128, q_dtype="bfloat16"),
    # INT8 codes at head dim 128 (128-byte rows, stored token-major: read as [tokens, J] tiles) under an
    # INT4 anchor, paged, GQA 2.
    Case("int8-int4-d128-token-major-paged", 128, 2, ((8, 32), (4, 32)), (130, 0, 256), 256, 128, paged=True),
    # A prompt chunk's rows, 136 > ROW_BLOCK (a block of 128 and a padded edge block), paged, key means.
    Case("paper-d64-chunk-rows-paged", 64, 136, PAPER, (130, 0), 256, 128, means=(True,) * 4, paged=True),
)


def _tiny(name, links, v_links=None):
    """A catalog or schedule chain at head dim 64, one row, one head, S = 48 as one page."""
    return Case(name, 64, 1, tuple(links), (48, 13), 48, 48, v_links=None if v_links is None else tuple(v_links),
                heads=1)


#: Every chain of the configuration matrix (`configs.CHAINS`: uniform/rotated/anchor, residual last- and
#: previous-loop references, mixed groups) and of the schedules the bit allocator emitted (docs/results/
#: allocation: per-link group sizes, keys and values apart; a covering set, `_base.covering`), at tiny shapes.
CHAIN_CASES = tuple(_tiny("catalog-" + configs.chain_name(links), links) for links in configs.CHAINS) + tuple(
    _tiny(name, cfg.links, cfg.v_links) for name, cfg in sorted(allocated_configs().items()))


def _check_case(case, races: bool = True):
    args, kw = make_inputs(case, seeded(case.name))
    block = {} if case.paged else {"block_s": case.page}
    out = tra.tpu_residual_decode_attention(*args, **kw, **block, interpret=interpret(races))
    jax.block_until_ready(out)
    assert not races_found()
    ref = tra.tpu_residual_decode_attention_reference(*args, **kw)
    assert_partial_close(out, ref, case.lengths, TOL[case.q_dtype])


@pytest.mark.parametrize("tpu_case", CASES, ids=[c.name for c in CASES])  # not `case`: conftest's for classes
def test_interpret_matches_reference(tpu_case):
    _check_case(tpu_case)


@pytest.mark.parametrize("tpu_case", CHAIN_CASES, ids=[c.name for c in CHAIN_CASES])
def test_shipped_chains_match_reference(tpu_case):
    """Race detection is left to CASES (the grid and DMAs do not change with the chain) and halves the time."""
    _check_case(tpu_case, races=False)


def test_reference_reads_through_the_table():
    """The reference over a pool equals the reference over the same pages laid out in order (and a wrong table
    does not): the kernel's comparisons check pages, not only arithmetic."""
    case = Case("table", 64, 2, ((2, 32), (4, 32)), (256, 200), 256, 128)
    args, kw = make_inputs(case, seeded(case.name))
    want = tra.tpu_residual_decode_attention_reference(*args, **kw)
    cache, table = paged_case(args[1:5], case.lengths, case.page, case.name)
    got = tra.tpu_residual_decode_attention_reference(args[0], *cache, *args[5:8], table, **kw)
    assert_partial_close(got, want, case.lengths, 1e-6)
    wrong = tra.tpu_residual_decode_attention_reference(args[0], *cache, *args[5:8], jnp.roll(table, 1, axis=1), **kw)
    assert not np.allclose(np.asarray(wrong[0]), np.asarray(want[0]), equal_nan=True)


def test_catalog_coverage():
    """Every chain, head dim and metadata dtype of the configuration matrix traces through the kernel."""
    seen, declined = set(), {}
    for cfg in configs.MATRIX:
        if not cfg.links or (cfg.dim, cfg.links, cfg.v_links, cfg.meta) in seen:
            continue
        seen.add((cfg.dim, cfg.links, cfg.v_links, cfg.meta))
        fn, args = dataclasses.replace(cfg, rows=1, heads=1, seq=128).call()
        try:
            jax.eval_shape(functools.partial(tra.tpu_residual_decode_attention, **fn.keywords), *args)
        except NotImplementedError as e:
            declined[cfg.name] = str(e)
    assert not declined, declined
    assert len(seen) >= 60, len(seen)


def _unsupported(**change):
    case = dataclasses.replace(Case("unsupported", 64, 1, ((2, 32),), (5, 0), 32, 32), **change)
    return make_inputs(case, seeded(case.name))


@pytest.mark.parametrize("change, message", [
    (dict(k_links=((3, 32),)), "3-bit"),
    (dict(k_links=((2, 4),)), "group size 4"),
    (dict(dim=72, k_links=((1, 8),)), "planes of 9"),
    (dict(q_dtype="float16"), "query dtype"),
])
def test_uncovered_configurations_raise(change, message):
    args, kw = _unsupported(**change)
    with pytest.raises(NotImplementedError, match=message):
        tra.tpu_residual_decode_attention(*args, **kw)


@pytest.mark.parametrize("bad, message", [
    (dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths must be"),
    (dict(block_table=jnp.zeros((3, 1), jnp.int32)), r"must be integer \[2, N\]"),
    (dict(block_table=jnp.zeros((2, 1), jnp.float32)), "must be integer"),
    (dict(block_table=jnp.zeros((2, 1), jnp.int32), block_s=128), "contradicts the pool's pages of 256"),
    (dict(k_bits=(4,)), "codes last dim"),
    (dict(k_alpha=(None,)), "k_alpha: 1 entries"),
    (dict(block_s=20), "multiple of 128"),
    (dict(generation="v3"), "no TPU launch entry"),
])
def test_bad_input_is_refused(bad, message):
    (q, keys, values, ka, va, means, lengths, slot, table), kw = _unsupported(s=256, page=256)
    args = dict(q=q, keys=keys, values=values, k_alpha=ka, v_alpha=va, mean_scores=means, lengths=lengths,
                slot=slot, block_table=table, **kw)
    args.update(bad)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        tra.tpu_residual_decode_attention(**args)


# ---- real compiles (libtpu) -------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(not td.libtpu_available(),
                                  reason="libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")
#: A synchronous copy in the compiled HLO of an array shaped like a cache operand [M=2, B or NP, K, ...]: a
#: relayout. Group 1: its trailing dims.
_COPY = re.compile(r"= \S+\[2,\d+,\d+,([\d,]+)\]\{[^}]*\} copy\(")


def abstract(d, rows, links, heads=16, s=4096, q_dtype=jnp.float32, meta=jnp.float8_e4m3fn, pages=None):
    """(fn with static link arguments, ShapeDtypeStructs) of one call at batch 8, 2 slots, α and key means: a
    contiguous cache of S tokens, or with `pages` a pool of 8·pages pages of S / pages tokens and its table."""
    sds = jax.ShapeDtypeStruct
    lead = (2, 8, heads, s) if not pages else (2, 8 * pages, heads, s // pages)  # contiguous, or a pool
    chain = tuple(tra.QuantStream(sds(lead + (d * bits // 8,), jnp.uint8), sds(lead + (d // g,), meta),
                                  sds(lead + (d // g,), meta)) for bits, g in links)
    alphas = tuple(sds(lead, jnp.bfloat16) for _ in links[1:])
    args = [sds((8, heads, rows, d), q_dtype), chain, chain, alphas, alphas,
            tuple(sds((8, heads, rows), jnp.float32) for _ in links), sds((8,), jnp.int32), sds((), jnp.int32)]
    if pages:
        args.append(sds((8, pages), jnp.int32))
    fn = functools.partial(tra.tpu_residual_decode_attention, k_bits=tuple(b for b, _ in links),
                           v_bits=tuple(b for b, _ in links), k_group_sizes=tuple(g for _, g in links),
                           v_group_sizes=tuple(g for _, g in links))
    return fn, args


#: name -> (call, the metadata group counts XLA:TPU stores group axis above the heads at these shapes, whose
#: per-call relayout is expected: module docstring). Ouro-1.4B decode (16 kv heads, head dim 128, 4k), a GQA
#: model's head dim 64 paged at 16k, and Huginn's head dim 96 (3 bf16 groups of 32 per token: relaid out).
COMPILE_CASES = {
    "ouro-paper-chain-d128-4k": (abstract(128, 1, PAPER), ()),
    "ouro-anchor-int4g32-d128-4k": (abstract(128, 1, ((4, 32),)), ()),
    # INT8 codes at head dim 128 are stored token-major: read so, with no relayout
    "int8g32-over-int4g32-d128-4k": (abstract(128, 1, ((8, 32), (4, 32))), ()),
    "gqa4-int2g16-int4g16-d64-bf16q-16k-paged256": (abstract(64, 4, ((2, 16), (4, 16)), heads=4, s=16384,
                                                             q_dtype=jnp.bfloat16, pages=64), ()),
    "huginn-int2g32-int4g32-d96-bf16meta-4k": (abstract(96, 1, ((2, 32), (4, 32)), meta=jnp.bfloat16), (3,)),
    # a 2048-token prompt chunk's rows (in blocks of ROW_BLOCK: in one, they overflowed v5e's scoped VMEM)
    "ouro-paper-chain-d128-chunk2048-4k": (abstract(128, 2048, PAPER), ()),
}


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiles_for_tpu(generation, name):
    (fn, args), relaid_groups = COMPILE_CASES[name]
    fn = functools.partial(fn, generation=generation)
    res = td.compile_for(fn, args, generation)
    assert res.ok, res.error
    assert len(res.kernels()) == 1 and res.kernels()[0].startswith("tpu_residual_decode_attention")
    assert res.vmem_limits == (tpu_launch.lookup(generation, "residual").vmem_limit_bytes,)
    assert res.generated_code_bytes > 0
    # Codes and α are read where they lie: the only relayout copies before the call are of the metadata
    # arrays the case names (none for the Ouro and GQA shapes).
    hlo = jax.jit(fn).lower(*td.place(args, generation)).compile().as_text()
    copied = {int(dims.split(",")[-1]) for dims in _COPY.findall(hlo)}
    assert copied == set(relaid_groups), [line.strip()[:160] for line in hlo.splitlines() if _COPY.search(line)]
