"""`dense_decode_attention` against its jnp reference, and its lowering."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from pallas_kernels import dense_attention as da

from ._base import DecodeKernelTestBase, array, normal


@dataclasses.dataclass(frozen=True)
class Case:
    """Batch = len(lengths); S stored positions; the last of `slots` slots."""

    name: str
    dim: int
    rows: int
    lengths: tuple = (37, 0)
    s: int = 100
    heads: int = 2
    slots: int = 2
    q_dtype: str = "float32"
    kv_dtype: str = "bfloat16"
    block_s: int | None = None
    num_splits: int | None = None


def make_inputs(case: Case, rng):
    b = len(case.lengths)
    kv = (case.slots, b, case.heads, case.s, case.dim)
    args = (array(rng, (b, case.heads, case.rows, case.dim), case.q_dtype, normal(1.0)),
            array(rng, kv, case.kv_dtype, normal()), array(rng, kv, case.kv_dtype, normal()),
            array(rng, (b,), "int32", lambda r, s: np.asarray(case.lengths)),
            array(rng, (), "int32", lambda r, s: np.asarray(case.slots - 1)))
    return args, dict(block_s=case.block_s, num_splits=case.num_splits)


CASES = (
    Case("d128-bf16kv-f32q", 128, 1, num_splits=2),
    Case("d96-bf16kv-bf16q-gqa", 96, 3, lengths=(1, 70), q_dtype="bfloat16", block_s=16, num_splits=3),
    Case("d64-f32kv-rows80", 64, 80, lengths=(0, 29), s=40, kv_dtype="float32"),
)

LOWER_CASES = tuple(
    Case(f"d{d}-{kv}kv-{q}q", d, 1, s=4096, heads=16, q_dtype=q, kv_dtype=kv)
    for d, q, kv in itertools.product((64, 96, 128), ("float32", "bfloat16"), ("bfloat16", "float32"))
) + (Case("d128-rows80", 128, 80),)


class TestDenseDecodeAttention(DecodeKernelTestBase):
    CASES = CASES
    LOWER_CASES = LOWER_CASES
    #: 16-token pages (the engine's: a tile per page), 32-token tiles across 48-token pages (per-token pages),
    #: float32 K/V with GQA rows.
    PAGED_CASES = ((Case("d128-paged", 128, 1, lengths=(100, 0, 257), s=320), 16),
                   (Case("d96-paged-f32kv-gqa", 96, 3, lengths=(47, 96), s=96, kv_dtype="float32", block_s=32), 48))
    SKIP_CASE = Case("skip", 32, 2, lengths=(0, 1, 16, 17, 33), s=96, block_s=16, num_splits=2)
    kernel = staticmethod(da.dense_decode_attention)
    reference = staticmethod(da.dense_decode_attention_reference)

    def make(self, case, rng):
        return make_inputs(case, rng)
