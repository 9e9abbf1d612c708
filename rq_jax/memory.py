"""Memory a generation will need, estimated before anything is allocated, the memory available, and
the check that refuses a run that would not fit (`check_fits`)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from rq_jax.cache import base
from rq_jax.cache.kv import init_cache
from rq_jax.config import ModelConfig


#: Copies alive at the peak (measured on CPU, Huginn-small at 5000 steps: 1.8 GB RSS against this
#: estimate's 1.8 GB): the cache given, its updated copy and the decode loop's carry; the in-flight K/V
#: as scan outputs and regrouped for the write; plus the runtime itself.
CACHE_COPIES, INFLIGHT_COPIES, RUNTIME_BYTES = 3, 2, 512 * 2**20


def generation_bytes(config: ModelConfig, fmt: base.CacheFormat, *, batch: int, prompt_len: int, max_len: int,
                     num_loops: int, param_bytes: int, plain_fmt: base.CacheFormat | None = None,
                     compute_itemsize: int = 4) -> dict[str, int]:
    """Peak bytes of a generation, by part: the cache (its arrays' exact shapes, nothing allocated,
    times `CACHE_COPIES`), the parameters, the prefill's in-flight K/V of every loop [L, N, B, K, T, D]
    (times `INFLIGHT_COPIES`), one layer's attention scores [B, H, T, S] and MLP activations [B, T, I],
    and the runtime."""
    shapes = jax.eval_shape(lambda: init_cache(config, batch, max_len, fmt, num_loops=num_loops, plain_fmt=plain_fmt))
    cache = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))
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
    from flax import nnx

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

