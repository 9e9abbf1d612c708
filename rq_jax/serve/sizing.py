"""How big the engine's cache pool and its steps are: pages of `page_size` tokens sized by a memory budget
or a number of `max_len` slots, the prompt chunk, the step's token budget and the largest decode batch,
checked against the host's memory before anything is allocated; and the compiled sizes of its calls (rows,
prompt widths) with the grouping of a step's prompt chunks into them (`prefill_groups`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.configs import TPU_PAGE
from rq_jax import memory
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.dense import Dense
from rq_jax.cache.kv import cache_bytes

#: The largest decode batch compiled when only a memory budget is given (`PoolSize.max_rows`): twice vLLM's
#: 256 on a GPU, since a compressed pool holds about 5x the requests of a dense one at the same budget.
DEFAULT_MAX_ROWS = 512

#: A step's tokens when none is given: vLLM's default for its OpenAI server on a CPU (max_num_batched_tokens).
DEFAULT_TOKEN_BUDGET = 2048


def compute_dtype(model) -> str:
    """The dtype a model computes in (its embedding's): the dtype of the K/V it produces."""
    return next(jnp.dtype(m.dtype).name for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Embed))


#: Tokens per page on a CPU. A pool leaf keeps a page's tokens of one kv head together, and a two-link residual
#: chain reads 14 such runs a page (codes, scales, offsets and α of keys and values), most of them 2 bytes a token:
#: at 16 tokens each is half a cache line at a random address, and the native kernel waits on memory page by page.
#: Alternating in one process, 64-token pages took residual's decode step to 0.85x its time on 16-token pages at
#: 64 rows of 768 tokens and 0.86x at 16 rows of 2,000, dense bf16's to 0.95x and 0.93x (docs/performance.md,
#: stop 65).
CPU_PAGE = 64


def default_page_size(platform: str | None = None) -> int:
    """Tokens per cache page on `platform` (default: the host's backend): `CPU_PAGE` (64) on a CPU,
    `configs.TPU_PAGE` (128: its kernels hold tokens on the 128 lanes, and XLA:TPU relays out a pool of smaller
    pages around every call) on a TPU, else 16 (a GPU's, as vLLM's)."""
    platform = platform or jax.default_backend()
    return {"cpu": CPU_PAGE, "tpu": TPU_PAGE}.get(platform, 16)


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """A pool of `num_pages` pages of `page_size` tokens, `page_bytes` each; prompts in chunks of `chunk`
    tokens, at most `token_budget` tokens and `max_rows` decoding requests a step; `prefix_cache` when its
    pages may be shared (not for a format paged by whole rows)."""

    page_size: int
    chunk: int
    token_budget: int
    num_pages: int
    page_bytes: int
    max_rows: int
    prefix_cache: bool


def size_pool(model, fmt: CacheFormat, plain_fmt: CacheFormat, *, max_len: int, num_loops: int,
              num_slots: int | None = None, memory_bytes: int | None = None, chunk: int = 256,
              token_budget: int | None = None, page_size: int | None = None, max_rows: int | None = None,
              prefix_cache: bool = True) -> PoolSize:
    """The `Engine`'s pool (its docstring names the arguments): `memory_bytes` of pages, or room for
    `num_slots` requests of `max_len`. A format whose state is not one entry per position (kivi's windows)
    takes whole rows as pages and shares nothing. Raises ValueError naming the setting that cannot work,
    MemoryError when the pool would not fit the host."""
    if not (fmt.pageable and plain_fmt.pageable):
        page_size, chunk, prefix_cache = max_len, min(chunk, max_len), False
    else:
        page_size = min(page_size or default_page_size(), max_len)
        chunk = max(page_size, min(chunk, max_len) // page_size * page_size)
    token_budget = token_budget or max(chunk, DEFAULT_TOKEN_BUDGET)
    if token_budget < chunk:
        raise ValueError(f"token_budget ({token_budget}) must hold a prompt chunk ({chunk})")
    pages_per_row = -(-max_len // page_size)
    page_bytes = cache_bytes(model.config, fmt, page_size, num_loops=num_loops, plain_fmt=plain_fmt).total
    if num_slots is not None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be ≥ 1, got {num_slots}")
        pages = num_slots * pages_per_row
    elif memory_bytes is not None:
        pages = memory_bytes // page_bytes
        if pages < pages_per_row:
            raise ValueError(f"{memory_bytes:,} bytes of cache hold {pages} pages of {page_size} tokens "
                             f"({page_bytes:,} bytes each): not one request of {max_len} tokens")
    else:
        raise ValueError("give num_slots or memory_bytes")
    memory.check_fits(model, fmt, batch=pages, prompt_len=1, max_len=page_size,  # the pool's bytes
                      num_loops=num_loops, compute_itemsize=jnp.dtype(compute_dtype(model)).itemsize,
                      what=f"a pool of {pages} pages", advice="use a smaller memory budget, fewer slots or a "
                      "shorter max_len")
    return PoolSize(page_size, chunk, token_budget, pages, page_bytes,
                    max_rows or num_slots or min(DEFAULT_MAX_ROWS, pages), prefix_cache)


def dense_token_bytes(config, num_loops: int) -> int:
    """Bytes of one token's K/V in dense bf16 (every loop and layer): what the pool's tokens would take
    uncompressed."""
    return cache_bytes(config, Dense("bfloat16"), 1, num_loops=num_loops, plain_fmt=Dense()).total


#: A call's fixed cost (dispatch, and its operations' overheads) in padded token slots: Ouro-small's prompt
#: call on this project's 2-core CPU host costs ~0.65 ms plus ~0.03 ms a slot (1 x 16 and 8 x 16 slots timed).
CALL_TOKENS = 32


def geometric(lo: int, hi: int, ratio: int) -> tuple[int, ...]:
    """lo, ratio·lo, ... below hi, then hi: the compiled sizes of a dimension (a call padded to the next
    size wastes less than `ratio`x on it)."""
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= ratio
    return tuple(out) + (hi,)


def row_counts(hi: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, ... (the powers of two and 1.5 times them) below hi, then hi: the compiled row
    counts of a decode step, whose cost grows with its rows. A step padded to the next count runs less than
    1.5x its rows (from 2 on), where powers of two alone would run up to 2x: Ouro-small's residual step over
    82 rows of ~440 tokens took 7.6 ms as 96 rows against 8.2 ms as 128 (docs/performance.md, stop 68)."""
    out = sorted({s for k in range(hi.bit_length()) for s in (2**k, 3 * 2**k // 2) if s < hi})
    return tuple(out) + (hi,)


def holding(sizes: Sequence[int], n: int) -> int | None:
    """The first of the ascending compiled `sizes` (`geometric`'s, `row_counts`') that holds `n`; None when
    none does."""
    return next((s for s in sizes if s >= n), None)


@functools.lru_cache(maxsize=None)
def call_sizes(count: int, width: int, rows: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """The cheapest way to run `count` prompt chunks in calls of `width` tokens over the compiled row counts
    `rows`: (its cost, the chunks of each call). A call costs `CALL_TOKENS` plus its padded token slots: one
    call padded to the fewest rows that hold the chunks, or a full call of fewer rows and the rest (9 chunks
    of 16 tokens: 8 + 1 rather than 16 rows)."""
    best = [(0, ())]  # best[n]: the cheapest calls of n chunks, built up from n = 1 (no recursion to run out of)
    for n in range(1, count + 1):
        fit = holding(rows, n)
        options = [] if fit is None else [(CALL_TOKENS + fit * width, (n,))]
        for r in sorted(rows, reverse=True):  # of equal costs, the one with the larger first call
            if r < n:
                options.append((CALL_TOKENS + r * width + best[n - r][0], (r, *best[n - r][1])))
        best.append(min(options, key=lambda o: o[0]))
    return best[count]


def prefill_groups(lengths: Sequence[int], buckets: Sequence[int], rows: dict[int, tuple[int, ...]]
                   ) -> list[list[int]]:
    """Prompt chunks of `lengths` tokens grouped into calls: the indices of each call's chunks. A chunk's width
    is the narrowest of `buckets` that holds it; the chunks of a run of consecutive widths share calls of the
    widest (`rows[width]`: its compiled row counts; `call_sizes` splits them), the runs chosen to cost the
    fewest padded slots (12-token prompts beside a 200-token one run in a 16-token call of their own, not
    padded to 256)."""
    by_width: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_width.setdefault(holding(buckets, n), []).append(i)
    widths = sorted(by_width)
    best: list[tuple[int, list[list[int]]]] = [(0, [])]  # best[j]: the cheapest calls of widths[:j]
    for j in range(1, len(widths) + 1):
        options = []
        for i in range(j):
            members = [c for w in widths[i:j] for c in by_width[w]]
            cost, sizes = call_sizes(len(members), widths[j - 1], rows[widths[j - 1]])
            starts = np.cumsum((0, *sizes))
            options.append((best[i][0] + cost, best[i][1] + [members[a:b] for a, b in zip(starts, starts[1:])]))
        best.append(min(options, key=lambda o: o[0]))
    return best[-1][1]
