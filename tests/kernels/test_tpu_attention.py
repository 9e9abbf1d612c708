"""The TPU (Mosaic) dense decode kernel: TPU interpret mode against its jnp reference, and real compiles for
v5e and v6e through libtpu (skipped where `jax[tpu]` is not installed).

Interpret mode (`pltpu.InterpretParams`) simulates HBM, VMEM, the pipeline's DMAs and two TensorCores on the
CPU, with the race detector on; uninitialised VMEM reads as NaN. Every cache position a row must not read
(past its length, on pages no row's valid prefix uses, in the other slot) is NaN here too, so a mask, page
or slot mistake shows as a non-finite or wrong output.

Tolerances (`_base.TOL`, of the largest |output|): the kernel's dots are the GPU kernels' precision path —
bf16 operands with float32 accumulation, float32 operands split into bf16 hi + lo (~2^-16 relative, lo·lo
dropped) — so the argument of `_base`'s docstring holds: bf16 K/V entries are exact, float32 queries or
float32 K/V carry ~2^-16 relative per product, p's split another 2^-16, summation order ~D·2^-24. Measured
here: at most 1.0e-5 of the largest |output| (float32 K/V with float32 queries, as the GPU kernel's 1.0e-5),
4.6e-6 with bfloat16 queries; the bounds (2e-4 float32 queries, 1e-4 bfloat16) keep a >= 20x margin and still
catch a wrong page (an O(1) change of acc), a dropped token or a missed rescale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_deviceless as td
from pallas_kernels import tpu_launch
from pallas_kernels.tpu_dense_attention import tpu_dense_decode_attention, tpu_dense_decode_attention_reference

from . import _base
from ._base import TOL, assert_partial_close, seeded

def interpret(races: bool = True):
    """The kernels' `interpret` argument: TPU interpret mode, with `races` detected across two simulated
    TensorCores (the parallel grid axes split between them); with RQ_PALLAS_INTERPRET=0
    (scripts/tpu_check.sh) False, the kernels compiled, and the test skipped off a TPU."""
    if not _base.INTERPRET:
        if jax.default_backend() != "tpu":
            pytest.skip("RQ_PALLAS_INTERPRET=0 needs a TPU")
        return False
    return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2) if races else pltpu.InterpretParams()


def races_found() -> bool:
    """Whether the last interpreted kernel raced (the detector's state lives in jax._src); False compiled."""
    if not _base.INTERPRET:
        return False
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # platform: interpret mode's race state

    return bool(interpret_pallas_call.races and interpret_pallas_call.races.races_found)


@dataclasses.dataclass(frozen=True)
class Case:
    """Batch = len(lengths); S stored positions in pages of `page` tokens; slot 1 of 2. `paged`: the cache as
    the serving engine's pool, each row's pages placed at random among twice as many (`_base.paged_case`:
    the others NaN, table entries past a row's pages -1 or past the pool), else contiguous with `page` as
    block_s."""

    name: str
    lengths: tuple
    s: int
    page: int
    dim: int = 128
    heads: int = 2
    rows: int = 1
    q_dtype: str = "float32"
    kv_dtype: str = "bfloat16"
    paged: bool = False


CASES = (
    # lengths 0, 1, block - 1, block, block + 1 and max_len; GQA group of 3 query heads per kv head
    Case("ragged-f32q-bf16kv-gqa3", (0, 1, 15, 16, 17, 48), 48, 16, rows=3),
    # a partial last block (S = 40 in blocks of 16: Mosaic pads the edge block) at max_len 40
    Case("edge-bf16q-f32kv", (40, 0, 33, 8), 40, 16, q_dtype="bfloat16", kv_dtype="float32"),
    Case("paged-f32q-f32kv", (17, 64, 1), 64, 8, kv_dtype="float32", paged=True),
    # head dims below 128: [D, tokens] tiles (`transposed`), pages of 128 tokens
    Case("paged-d64-bf16q-bf16kv-gqa4", (256, 129, 0, 127), 256, 128, dim=64, heads=1, rows=4, q_dtype="bfloat16",
         paged=True),
    Case("edge-d96-f32q-bf16kv", (200, 128, 1), 200, 128, dim=96, heads=1, rows=2),
    # a prompt chunk's rows: 136 > ROW_BLOCK, in a block of 128 and a padded edge block of 8
    Case("chunk-rows-f32q-bf16kv", (40, 0, 17), 48, 16, heads=1, rows=136),
)


def make_inputs(case: Case, rng: np.random.Generator):
    """(q, k, v, lengths, slot, block_table) with every position no row may read set to NaN."""
    b, n = len(case.lengths), -(-case.s // case.page)
    q = rng.standard_normal((b, case.heads, case.rows, case.dim))
    kv = rng.standard_normal((2, 2, b, case.heads, n * case.page, case.dim))
    lengths = np.asarray(case.lengths, np.int32)
    kv[:, 1] = np.where((np.arange(n * case.page)[None, :] < lengths[:, None])[:, None, :, None], kv[:, 1], np.nan)
    kv[:, 0] = np.nan
    k, v = (jnp.asarray(x[:, :, :, :case.s], case.kv_dtype) for x in kv)
    table = None
    if case.paged:
        (k, v), table = _base.paged_case((k, v), case.lengths, case.page, case.name)
    return jnp.asarray(q, case.q_dtype), k, v, jnp.asarray(lengths), jnp.int32(1), table


@pytest.mark.parametrize("tpu_case", CASES, ids=[c.name for c in CASES])  # not `case`: conftest's for classes
def test_interpret_matches_reference(tpu_case):
    case = tpu_case
    args = make_inputs(case, seeded(case.name))
    kw = {} if case.paged else {"block_s": case.page}
    out = tpu_dense_decode_attention(*args, **kw, interpret=interpret())
    jax.block_until_ready(out)
    assert not races_found()
    ref = tpu_dense_decode_attention_reference(*args)
    assert_partial_close(out, ref, case.lengths, TOL[case.q_dtype])


def test_reference_reads_through_the_table():
    """The reference over a pool equals the reference over the same cache laid out contiguously, and a wrong
    table changes it: the kernel's comparison above checks pages, not only arithmetic."""
    case = Case("reference-table", (32, 21), 32, 8, dim=16)
    q, k, v, lengths, slot, _ = make_inputs(case, seeded(case.name))
    want = tpu_dense_decode_attention_reference(q, k, v, lengths, slot)
    (pk, pv), table = _base.paged_case((k, v), case.lengths, case.page, case.name)
    got = tpu_dense_decode_attention_reference(q, pk, pv, lengths, slot, table)
    assert_partial_close(got, want, np.asarray(lengths), 1e-6)
    wrong = tpu_dense_decode_attention_reference(q, pk, pv, lengths, slot, jnp.roll(table, 1, axis=1))
    assert not np.allclose(np.asarray(wrong[0]), np.asarray(want[0]), equal_nan=True)


@pytest.mark.parametrize("bad, message", [
    (dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths must be"),
    (dict(block_table=jnp.zeros((3, 4), jnp.int32)), r"must be integer \[2, N\]"),
    (dict(block_table=jnp.zeros((2, 4), jnp.float32)), "must be integer"),
    (dict(block_table=jnp.zeros((2, 4), jnp.int32), block_s=16), "contradicts the pool's pages of 32"),
    (dict(k=jnp.zeros((1, 2, 1, 32, 16), jnp.bfloat16), block_table=None, q=jnp.zeros((3, 1, 1, 16))),
     "a paged pool needs a block_table"),
    (dict(block_s=12), "needs a multiple of 128"),
    (dict(generation="v3"), "no TPU launch entry"),
])
def test_bad_input_is_refused(bad, message):
    args = dict(q=jnp.zeros((2, 1, 1, 16)), k=jnp.zeros((1, 2, 1, 32, 16), jnp.bfloat16),
                v=jnp.zeros((1, 2, 1, 32, 16), jnp.bfloat16), lengths=jnp.zeros((2,), jnp.int32), slot=0)
    args.update(bad)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        tpu_dense_decode_attention(**args)


def test_generation_names():
    kinds = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e"}
    assert {kind: tpu_launch.generation_of(kind) for kind in kinds} == kinds
    with pytest.raises(ValueError, match="not a TPU generation"):
        tpu_launch.generation_of("cpu")


# ---- real compiles (libtpu) -------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(not td.libtpu_available(),
                                  reason="libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")


def abstract(b, heads, rows, d, s, q_dtype, kv_dtype, pages=None):
    """ShapeDtypeStructs of one call (2 slots): a contiguous [2, B, K, S, D] cache, or with `pages` a pool of
    B·pages pages of S / pages tokens and a [B, pages] block table."""
    sds = jax.ShapeDtypeStruct
    stored = (2, b, heads, s, d) if not pages else (2, b * pages, heads, s // pages, d)
    args = [sds((b, heads, rows, d), q_dtype), sds(stored, kv_dtype), sds(stored, kv_dtype), sds((b,), jnp.int32),
            sds((), jnp.int32)]
    return args + ([sds((b, pages), jnp.int32)] if pages else [])


#: Ouro-1.4B-like decode shapes (batch 8, 16 kv heads, head dim 128 or 64), contiguous and paged.
COMPILE_CASES = {
    "d128-bf16kv-f32q-4k": abstract(8, 16, 1, 128, 4096, jnp.float32, jnp.bfloat16),
    "d64-bf16kv-bf16q-gqa4-16k-paged256": abstract(8, 4, 4, 64, 16384, jnp.bfloat16, jnp.bfloat16, pages=64),
    "d128-f32kv-f32q-4k": abstract(4, 8, 2, 128, 4096, jnp.float32, jnp.float32),
    # a 2048-token prompt chunk's rows over a 4k past (in one block its scores overflowed v5e's scoped VMEM)
    "d128-bf16kv-bf16q-chunk2048-4k": abstract(1, 16, 2048, 128, 4096, jnp.bfloat16, jnp.bfloat16),
}


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiles_for_tpu(generation, name):
    args = COMPILE_CASES[name]
    res = td.compile_for(functools.partial(tpu_dense_decode_attention, generation=generation), args, generation)
    assert res.ok, res.error
    assert len(res.kernels()) == 1 and res.kernels()[0].startswith("tpu_dense_decode_attention")
    kv_dtype = jnp.dtype(args[1].dtype).name
    assert res.vmem_limits == (tpu_launch.lookup(generation, f"dense-{kv_dtype}").vmem_limit_bytes,)
    assert res.generated_code_bytes > 0
    # No cache-sized temporaries (XLA's own decode path holds 0.5x the cache on a v5e): the kernel reads the
    # cache in place.
    assert res.temp_bytes < res.argument_bytes // 100
    assert tpu_launch.generation_of(td.topology(generation).devices[0].device_kind) == generation


@needs_libtpu
def test_compile_refuses_a_block_over_vmem():
    """A 32k-token bf16 block at head dim 128 (8 MiB per K or V tile, each double-buffered) exceeds v5e's
    16 MiB scoped VMEM: the compiler refuses it, and `compile_for` reports that instead of raising."""
    args = abstract(1, 1, 1, 128, 32768, jnp.bfloat16, jnp.bfloat16)
    res = td.compile_for(functools.partial(tpu_dense_decode_attention, generation="v5e", block_s=32768), args, "v5e")
    assert not res.ok and "RESOURCE_EXHAUSTED" in res.error and res.kernels() == ()
