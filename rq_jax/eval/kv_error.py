"""K/V reconstruction error of a cache format on a model's real K/V.

The model runs once with a dense float32 cache; the stored K/V of every (loop, layer) slot are then
encoded by the format in one `write` and decoded with `reconstruct`, so the error is the format's
alone (no error feedback through later loops or tokens).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from rq_jax.cache import Dense, init_cache
from rq_jax.cache.base import CacheFormat


def dense_kv(model, tokens: Int[Array, "b t"], num_loops: int, **model_kwargs):
    """The looped slots' K and V [L, N, B, K, T, D] (float32) after a prefill of `tokens`."""
    cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], Dense("float32"), num_loops=num_loops)
    loops_kw = {"num_loops" if model.config.family == "ouro" else "num_steps": num_loops}
    looped = model(tokens, cache, **loops_kw, **model_kwargs).cache.looped
    return looped.k, looped.v


def reconstruction_error(fmt: CacheFormat, k: Array, v: Array, calib: Any = None) -> dict[str, np.ndarray]:
    """Normalised squared error ‖X̂ − X‖² / ‖X‖² per loop for K and V [L, N, B, K, S, D].

    Returns {"k": [L], "v": [L]} (numpy), each summed over layers, batch, heads and tokens. A format
    that needs data is calibrated on these K/V when `calib` is None.
    """
    num_loops, num_layers, batch, heads, seq, dim = k.shape
    state = fmt.init(num_loops, num_layers, batch, seq, heads, dim)
    lengths = jnp.full((batch,), seq, jnp.int32)
    if calib is None and fmt.needs_data:
        calib = fmt.calibrate(k, v, lengths)
    state = fmt.write(state, k, v, jnp.zeros_like(lengths), lengths, calib)
    err = {"k": np.zeros(num_loops), "v": np.zeros(num_loops)}
    for loop in range(num_loops):
        for layer in range(num_layers):
            k_hat, v_hat = fmt.reconstruct(state, loop, layer, calib)
            for name, ref, hat in (("k", k, k_hat), ("v", v, v_hat)):
                err[name][loop] += float(jnp.sum((hat - ref[loop, layer]) ** 2))
    for name, ref in (("k", k), ("v", v)):
        err[name] /= np.asarray(jnp.sum(ref.astype(jnp.float32) ** 2, axis=(1, 2, 3, 4, 5)))
    return err
