"""Memory: what a generation will need, estimated before anything is allocated, the memory available,
the check that refuses a run that would not fit (`check_fits`); what a compiled step takes by XLA's
own memory analysis (`step_memory`), the largest batch a budget holds (`largest_fitting`), and the
byte limits of a format against dense bf16 (`byte_limits`)."""

from __future__ import annotations

import math
import os

import jax
from flax import nnx

from rq_jax.cache import base
from rq_jax.cache.kv import cache_bytes
from rq_jax.config import ModelConfig


#: Copies alive at the peak (measured on CPU, Huginn-small at 5000 steps: 1.8 GB RSS against this
#: estimate's 1.8 GB): the cache given, its updated copy and the decode loop's carry; the in-flight K/V
#: as scan outputs and regrouped for the write; plus the runtime itself.
CACHE_COPIES, INFLIGHT_COPIES, RUNTIME_BYTES = 3, 2, 512 * 2**20


def generation_bytes(config: ModelConfig, fmt: base.CacheFormat, *, batch: int, prompt_len: int, max_len: int,
                     num_loops: int, param_bytes: int, plain_fmt: base.CacheFormat | None = None,
                     compute_itemsize: int = 4) -> dict[str, int]:
    """Peak bytes of a generation, by part: the cache (`cache_bytes`: its arrays' exact shapes, nothing
    allocated, times `CACHE_COPIES`), the parameters, the prefill's in-flight K/V of every loop [L, N, B, K, T, D]
    (times `INFLIGHT_COPIES`), one layer's attention scores [B, H, T, S] and MLP activations [B, T, I],
    and the runtime."""
    cache = cache_bytes(config, fmt, max_len, batch=batch, num_loops=num_loops, plain_fmt=plain_fmt).total
    layers = num_loops * config.num_layers + config.num_plain_layers
    inflight = 2 * layers * batch * config.num_kv_heads * prompt_len * config.head_dim * compute_itemsize
    scores = batch * config.num_heads * prompt_len * max_len * 4
    mlp = 3 * batch * prompt_len * config.intermediate_size * compute_itemsize
    parts = dict(cache=CACHE_COPIES * cache, params=param_bytes, inflight=INFLIGHT_COPIES * inflight,
                 transient=scores + mlp, runtime=RUNTIME_BYTES)
    return {**parts, "total": sum(parts.values())}


def available_bytes() -> int | None:
    """Memory the OS reports available (Linux `MemAvailable`), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(model, fmt: base.CacheFormat, *, batch: int, prompt_len: int, max_len: int, num_loops: int,
               compute_itemsize: int = 4, caches: int = 1, what: str = "this run", advice: str = "") -> None:
    """Raise MemoryError with the estimate when `caches` caches of `fmt` (plus everything
    `generation_bytes` counts) would not fit in the memory available; nothing is allocated."""
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    need = generation_bytes(model.config, fmt, batch=batch, prompt_len=prompt_len, max_len=max_len,
                            num_loops=num_loops, param_bytes=param_bytes, compute_itemsize=compute_itemsize)
    need["cache"] *= caches
    need["total"] = sum(v for k, v in need.items() if k != "total")
    have = available_bytes()
    if have is not None and need["total"] > have:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items() if k != "total")
        raise MemoryError(f"{what} needs about {need['total'] / 2**30:.2f} GiB ({parts}) but only "
                          f"{have / 2**30:.2f} GiB is available" + (f"; {advice}" if advice else ""))


def byte_limits(fmt: base.CacheFormat, config: ModelConfig, context: int) -> dict[str, float]:
    """The bits per element a cache of `context` positions in `fmt` stores and a decode step reads, over
    all its slots (`cache_bytes`: looped slots with `fmt` over the config's loops, Huginn's plain slots
    with `fmt` as a one-loop group), and dense bf16's bytes over those: the most a format can gain over
    dense in capacity (storage) and in a bandwidth-bound step's speed (read)."""
    row = cache_bytes(config, fmt, context)
    return dict(storage_bits=float(row.mean_bits_per_element), read_bits=float(row.read_bits_per_element),
                storage_limit=row.dense / row.total, read_limit=row.dense / row.read)


def step_memory(compiled, weights: int, cache: int) -> dict[str, int]:
    """The compiled step's bytes by XLA's `memory_analysis`: total = arguments + outputs − aliased +
    temporaries + generated code; `other` is the total less weights, cache and temporaries."""
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(f"XLA reports no memory analysis on {jax.default_backend()}")
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
             + m.generated_code_size_in_bytes)
    return dict(total=int(total), weights=weights, cache=cache, temp=int(m.temp_size_in_bytes),
                other=int(total - weights - cache - m.temp_size_in_bytes))


def largest_fitting(total, budget: int, cap: int, estimates: int = 6) -> tuple[int, dict[int, int]]:
    """Largest batch b ≤ cap with total(b) ≤ budget (0: none), for total non-decreasing in b, and the
    totals it evaluated (b + 1 always among them unless b = cap).

    Memory is affine in the batch past a small-batch plateau (where temporaries share buffers), so the
    first `estimates` candidates are secant estimates through the two batches evaluated last (1 and 2
    at first), kept inside the bracket; then steps that double bracket the answer and bisection
    closes it."""
    seen: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in seen:
            seen[b] = total(b)
        return seen[b] <= budget

    if not fits(1):
        return 0, seen
    lo, hi, last = 1, None, [1]  # fits(lo); hi (once known) does not fit; last: batches in order
    while lo < cap and (hi is None or hi - lo > 1):
        upper = cap if hi is None else hi - 1
        a, b = (last[-2], last[-1]) if len(last) > 1 else (None, None)
        if len(last) <= estimates and a is not None and seen[a] != seen[b]:
            guess = b + math.floor((budget - seen[b]) * (b - a) / (seen[b] - seen[a]))
        elif len(last) <= estimates or hi is None:  # flat so far, or no bracket yet: double
            guess = 2 * lo
        else:
            guess = (lo + hi) // 2
        guess = min(max(guess, lo + 1), upper)
        last.append(guess)
        if fits(guess):
            lo = guess
        else:
            hi = guess
    return lo, seen
