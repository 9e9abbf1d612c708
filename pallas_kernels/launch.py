"""Launch parameters of the decode kernels: a small static table, chosen per configuration.

Like tokamax's per-op config tables, the entries come from compiling every candidate for the
configuration's class without a GPU (`scripts/kernel_report.py --sweep`, Triton's CUDA pipeline and
ptxas for sm_90 and sm_80) and keeping, among the candidates that compile with no spills on both
targets, the one with the most tokens in flight per SM (see `scripts/kernel_report.py`). The dispatch
reads it whenever a caller leaves block_s / block_r / num_warps / num_stages unset, which is what
`rq_jax.cache.residual.attend_pallas` does.

A class is `LaunchKey`: the kernel (with the K/V dtype for dense), the head dim bucket (64, 96, 128:
the next one up), the number of chain links (1-4) and the finest group size (16, or 32 and up), and the
row block the rows ask for (16, 32 or 64). Classes outside the table (head dims above 128, chains longer than 4) get `FALLBACK`,
which is not checked by the report.
"""

from __future__ import annotations

from typing import NamedTuple


class Launch(NamedTuple):
    """Tokens per tile, Triton warps and pipeline stages, and the most query rows per program."""

    block_s: int
    num_warps: int
    num_stages: int
    max_block_r: int


class LaunchKey(NamedTuple):
    kernel: str     # "residual", or "dense-bfloat16" / "dense-float32" (the K/V dtype)
    dim: int        # head dim bucket: 64, 96 or 128
    links: int      # chain links (0 for dense)
    group: int      # finest metadata group: 16 or 32 (32 stands for >= 32; 0 for dense)
    block_r: int    # the row block the rows ask for: 16, 32 or 64


DIM_BUCKETS = (64, 96, 128)
ROW_BLOCKS = (16, 32, 64)
FALLBACK = Launch(16, 4, 2, 16)

# Filled from `python scripts/kernel_report.py --sweep` (see docs/performance.md, "The kernels compiled").
TABLE: dict[LaunchKey, Launch] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def row_block(rows: int) -> int:
    """The row block `rows` query rows ask for: a power of two in ROW_BLOCKS."""
    return min(_next_pow2(max(rows, ROW_BLOCKS[0])), ROW_BLOCKS[-1])


def key(kernel: str, dim: int, rows: int, groups: tuple[int, ...] = ()) -> LaunchKey | None:
    """The table class of a call (None when no bucket covers it). `groups`: each link's group size."""
    bucket = next((b for b in DIM_BUCKETS if dim <= b), None)
    if bucket is None or len(groups) > 4:
        return None
    block_r = row_block(rows)
    if kernel.startswith("dense"):
        return LaunchKey(kernel, bucket, 0, 0, block_r)
    return LaunchKey(kernel, bucket, len(groups), 16 if min(groups) < 32 else 32, block_r)


def lookup(kernel: str, dim: int, rows: int, groups: tuple[int, ...] = ()) -> Launch:
    """The table's launch parameters for a call, or FALLBACK."""
    return TABLE.get(key(kernel, dim, rows, groups), FALLBACK)
