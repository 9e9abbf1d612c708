"""Launch parameters of the decode kernels: a small static table, chosen per configuration.

Like tokamax's per-op config tables, the entries come from compiling candidates for a representative
configuration of each class without a GPU (`scripts/kernel_report.py --sweep`: Triton's CUDA pipeline
and ptxas for sm_90 and sm_80) and keeping the first, in the sweep's order of preference (the class's
own row block before 16 rows, 4 warps before 8, the largest tile first), that compiles with no spills on
both targets. `OVERRIDES` corrects the sweep where a configuration of a class spilled with its choice or
no candidate of the per-group key path fits. The dispatch reads `lookup` whenever a caller leaves
block_s / block_r / num_warps / num_stages unset, which is what `rq_jax.cache.loop_quant.attend_pallas`
does.

A class is `LaunchKey`: the kernel (with the K/V dtype for dense), the head dim bucket (64, 96, 128:
the next one up), the number of chain links (1-4) and the finest group size (16, or 32 and up), and the
row block the rows ask for (16, 32 or 64). Classes outside the table (head dims above 128, chains longer
than 4) get `FALLBACK`, which is not checked by the report.
"""

from __future__ import annotations

from typing import NamedTuple


class Launch(NamedTuple):
    """Tokens per tile, Triton warps and pipeline stages, the most query rows per program, and whether the
    residual kernel forms its keys as one reconstructed tile (one dot) instead of per-group dots."""

    block_s: int
    num_warps: int
    num_stages: int
    max_block_r: int
    dequant_keys: bool = False


class LaunchKey(NamedTuple):
    kernel: str     # "residual", or "dense-bfloat16" / "dense-float32" (the K/V dtype)
    dim: int        # head dim bucket: 64, 96 or 128
    links: int      # chain links (0 for dense)
    group: int      # finest metadata group: 16 or 32 (32 stands for >= 32; 0 for dense)
    block_r: int    # the row block the rows ask for: 16, 32 or 64


DIM_BUCKETS = (64, 96, 128)
ROW_BLOCKS = (16, 32, 64)
FALLBACK = Launch(16, 4, 2, 16)

#: Set by hand over the sweep's choice:
#: - 3-link g32 chains at head dim 128: 8 warps, not the sweep's 4 — its representative has key means;
#:   without them the 4-warp build spills 24 B stored / 12 B loaded on sm_90 (issue 23's chain3 case, found
#:   by the CI subset); 8 warps compile clean on both targets.
#: - 3- and 4-link g16 chains at head dims 96 and 128: no candidate of the per-group key path fits (8-16 B
#:   spilled at 255 registers with 16-token tiles, 16 rows and 8 warps, 1 stage too): at g16 a 4-link D128
#:   chain makes 32 per-group dots per tile. They form their keys as one reconstructed tile instead
#:   (`dequant_keys`), with 16-token tiles: 4-link chains at 8 warps (142-198 registers; at 4 warps the
#:   D96 ones sit at 255), 3-link D128 chains at 4 warps (151-239; at 8 warps ptxas caps the INT2-anchor
#:   chain at 128 registers for two blocks per SM and spills 8 B on sm_80).
#: - one-link g32 chains at head dim 128 and one row block: 8 warps, not the sweep's 4 — at 4 warps ptxas
#:   aims at 4-5 blocks per SM and the INT4 anchor spills 8 B stored / 4 B loaded on sm_90 (float32
#:   metadata with 32-token tiles, bfloat16 / float16 metadata with 16-token tiles); at 8 warps every
#:   configuration of the class compiles clean on both targets (110-172 registers).
OVERRIDES = {
    **{LaunchKey("residual", 128, 3, 32, r): Launch(16, 8, 2, 16) for r in ROW_BLOCKS},
    LaunchKey("residual", 128, 1, 32, 16): Launch(32, 8, 2, 16),
    **{LaunchKey("residual", d, n, 16, r): Launch(16, 8 if n == 4 else 4, 2, 16, dequant_keys=True)
       for d, n in ((96, 4), (128, 3), (128, 4)) for r in ROW_BLOCKS},
    # `python scripts/kernel_report.py --refit` on the whole matrix's report: the classes where one of
    # their configurations spilled with the sweep's choice (8-60 B; INT8 g16 codes, D96 g32 loops, g32
    # chains at 32-64 rows), each re-chosen on every configuration of the class.
    LaunchKey("residual", 64, 1, 16, 16): Launch(32, 4, 2, 16),
    LaunchKey("residual", 64, 1, 16, 32): Launch(16, 4, 2, 32),
    LaunchKey("residual", 64, 1, 32, 16): Launch(32, 4, 2, 16),
    LaunchKey("residual", 64, 2, 32, 32): Launch(32, 4, 2, 32),
    LaunchKey("residual", 64, 3, 32, 32): Launch(32, 4, 2, 32),
    LaunchKey("residual", 64, 4, 32, 16): Launch(16, 4, 2, 16, dequant_keys=True),
    LaunchKey("residual", 64, 4, 32, 64): Launch(32, 8, 2, 16),
    # Two-link D64 chains whose finest group is 16 at one row block, with the bit allocator's schedules
    # (docs/results/allocation) in the class: INT2 g32 keys over an INT4 g64 anchor beside INT2 g64 / g16
    # values spills 40 B on sm_90 with the sweep's (64, 8, 2); every candidate of the per-group key path
    # spills on one of the class's 14 configurations, and reconstructed keys in 16-token tiles at 8 warps
    # compile all of them clean on both targets (75-127 registers).
    LaunchKey("residual", 64, 2, 16, 16): Launch(16, 8, 2, 16, dequant_keys=True),
    LaunchKey("residual", 96, 2, 32, 16): Launch(32, 8, 2, 16),
    LaunchKey("residual", 96, 2, 32, 32): Launch(16, 4, 2, 16),
    LaunchKey("residual", 96, 2, 32, 64): Launch(32, 8, 2, 16),
    LaunchKey("residual", 128, 1, 16, 32): Launch(16, 4, 2, 32),
    LaunchKey("residual", 128, 1, 16, 64): Launch(64, 8, 2, 16),
    LaunchKey("residual", 128, 1, 32, 32): Launch(16, 4, 2, 32),
    LaunchKey("residual", 128, 4, 32, 64): Launch(16, 4, 2, 16, dequant_keys=True),
}

#: Paged calls (rows read through a block table, tiles of at most a page: `decode_common.tile_block`) of the
#: classes where the matrix over the engine's 16-token pages spilled with the class's choice (16 of 706
#: compiles, 8-32 B; mostly 8-warp builds that ptxas holds to 128 registers for two blocks per SM), each
#: re-chosen on all the class's paged configurations for both targets: `python scripts/kernel_report.py
#: --page 16 --json paged.json`, then `--page 16 --refit paged.json`, with the chosen tile written as the 16
#: tokens it runs at (docs/performance.md, "On a GPU: the Pallas kernels read the pool").
PAGED_OVERRIDES: dict[LaunchKey, Launch] = {
    LaunchKey('residual', 64, 1, 32, 16): Launch(16, 4, 2, 16, True),
    LaunchKey('residual', 64, 2, 32, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 64, 3, 16, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 64, 3, 32, 32): Launch(16, 8, 2, 32),
    LaunchKey('residual', 64, 4, 16, 16): Launch(16, 4, 2, 16, True),
    LaunchKey('residual', 64, 4, 32, 64): Launch(16, 8, 2, 64, True),
    LaunchKey('residual', 96, 1, 32, 16): Launch(16, 4, 2, 16, True),
    LaunchKey('residual', 96, 3, 32, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 2, 32, 64): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 4, 16, 32): Launch(16, 4, 2, 16, True),
    LaunchKey('residual', 128, 4, 16, 64): Launch(16, 8, 2, 16),
}

# Filled from `python scripts/kernel_report.py --sweep` (see docs/performance.md, "The kernels compiled").
TABLE: dict[LaunchKey, Launch] = {
    LaunchKey('dense-bfloat16', 64, 0, 0, 16): Launch(64, 4, 2, 16),
    LaunchKey('dense-bfloat16', 64, 0, 0, 32): Launch(64, 4, 2, 32),
    LaunchKey('dense-bfloat16', 64, 0, 0, 64): Launch(32, 4, 2, 64),
    LaunchKey('dense-bfloat16', 96, 0, 0, 16): Launch(64, 4, 2, 16),
    LaunchKey('dense-bfloat16', 96, 0, 0, 32): Launch(64, 4, 2, 32),
    LaunchKey('dense-bfloat16', 96, 0, 0, 64): Launch(32, 4, 2, 64),
    LaunchKey('dense-bfloat16', 128, 0, 0, 16): Launch(64, 4, 2, 16),
    LaunchKey('dense-bfloat16', 128, 0, 0, 32): Launch(64, 4, 2, 32),
    LaunchKey('dense-bfloat16', 128, 0, 0, 64): Launch(32, 4, 2, 64),
    LaunchKey('dense-float32', 64, 0, 0, 16): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 64, 0, 0, 32): Launch(32, 4, 2, 32),
    LaunchKey('dense-float32', 64, 0, 0, 64): Launch(16, 4, 2, 64),
    LaunchKey('dense-float32', 96, 0, 0, 16): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 96, 0, 0, 32): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 96, 0, 0, 64): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 128, 0, 0, 16): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 128, 0, 0, 32): Launch(32, 4, 2, 16),
    LaunchKey('dense-float32', 128, 0, 0, 64): Launch(32, 4, 2, 16),
    LaunchKey('residual', 64, 1, 16, 16): Launch(64, 4, 2, 16),
    LaunchKey('residual', 64, 1, 16, 32): Launch(64, 4, 2, 32),
    LaunchKey('residual', 64, 1, 16, 64): Launch(16, 4, 2, 64),
    LaunchKey('residual', 64, 1, 32, 16): Launch(64, 4, 2, 16),
    LaunchKey('residual', 64, 1, 32, 32): Launch(32, 4, 2, 32),
    LaunchKey('residual', 64, 1, 32, 64): Launch(32, 4, 2, 64),
    LaunchKey('residual', 64, 2, 16, 16): Launch(64, 8, 2, 16),
    LaunchKey('residual', 64, 2, 16, 32): Launch(64, 8, 2, 32),
    LaunchKey('residual', 64, 2, 16, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 64, 2, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 64, 2, 32, 32): Launch(16, 4, 2, 32),
    LaunchKey('residual', 64, 2, 32, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 64, 3, 16, 16): Launch(32, 8, 2, 16),
    LaunchKey('residual', 64, 3, 16, 32): Launch(32, 8, 2, 16),
    LaunchKey('residual', 64, 3, 16, 64): Launch(32, 8, 2, 16),
    LaunchKey('residual', 64, 3, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 64, 3, 32, 32): Launch(16, 4, 2, 32),
    LaunchKey('residual', 64, 3, 32, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 64, 4, 16, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 64, 4, 16, 32): Launch(16, 8, 2, 16),
    LaunchKey('residual', 64, 4, 16, 64): Launch(16, 8, 2, 16),
    LaunchKey('residual', 64, 4, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 64, 4, 32, 32): Launch(32, 8, 2, 32),
    LaunchKey('residual', 64, 4, 32, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 96, 1, 16, 16): Launch(32, 4, 2, 16),
    LaunchKey('residual', 96, 1, 16, 32): Launch(32, 4, 2, 32),
    LaunchKey('residual', 96, 1, 16, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 96, 1, 32, 16): Launch(32, 4, 2, 16),
    LaunchKey('residual', 96, 1, 32, 32): Launch(32, 4, 2, 32),
    LaunchKey('residual', 96, 1, 32, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 96, 2, 16, 16): Launch(32, 8, 2, 16),
    LaunchKey('residual', 96, 2, 16, 32): Launch(32, 8, 2, 16),
    LaunchKey('residual', 96, 2, 16, 64): Launch(32, 8, 2, 16),
    LaunchKey('residual', 96, 2, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 96, 2, 32, 32): Launch(32, 8, 2, 32),
    LaunchKey('residual', 96, 2, 32, 64): Launch(16, 4, 2, 16),
    LaunchKey('residual', 96, 3, 16, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 96, 3, 16, 32): Launch(16, 8, 2, 16),
    LaunchKey('residual', 96, 3, 16, 64): Launch(16, 8, 2, 16),
    LaunchKey('residual', 96, 3, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 96, 3, 32, 32): Launch(16, 4, 2, 16),
    LaunchKey('residual', 96, 3, 32, 64): Launch(16, 4, 2, 16),
    LaunchKey('residual', 96, 4, 32, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 96, 4, 32, 32): Launch(16, 8, 2, 16),
    LaunchKey('residual', 96, 4, 32, 64): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 1, 16, 16): Launch(32, 4, 2, 16),
    LaunchKey('residual', 128, 1, 16, 32): Launch(32, 4, 2, 32),
    LaunchKey('residual', 128, 1, 16, 64): Launch(32, 4, 2, 16),
    LaunchKey('residual', 128, 1, 32, 16): Launch(32, 4, 2, 16),
    LaunchKey('residual', 128, 1, 32, 32): Launch(32, 4, 2, 32),
    LaunchKey('residual', 128, 1, 32, 64): Launch(16, 8, 2, 64),
    LaunchKey('residual', 128, 2, 16, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 2, 16, 32): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 2, 16, 64): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 2, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 2, 32, 32): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 2, 32, 64): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 3, 32, 16): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 3, 32, 32): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 3, 32, 64): Launch(16, 4, 2, 16),
    LaunchKey('residual', 128, 4, 32, 16): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 4, 32, 32): Launch(16, 8, 2, 16),
    LaunchKey('residual', 128, 4, 32, 64): Launch(16, 8, 2, 16),
}


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


def lookup(kernel: str, dim: int, rows: int, groups: tuple[int, ...] = (), paged: bool = False) -> Launch:
    """The launch parameters for a call (`paged`: through a block table): PAGED_OVERRIDES' for a paged call,
    else OVERRIDES', else TABLE's, else FALLBACK."""
    k = key(kernel, dim, rows, groups)
    return (paged and PAGED_OVERRIDES.get(k)) or OVERRIDES.get(k) or TABLE.get(k, FALLBACK)
