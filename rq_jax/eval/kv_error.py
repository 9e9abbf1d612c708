"""K/V reconstruction error of a cache format on a model's real K/V.

The model runs once with a dense float32 cache; the stored K/V of every (loop, layer) slot are then
encoded by the format in one `write` per loop segment and decoded with `reconstruct`, so the error is
the format's alone (no error feedback through later loops or tokens).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rq_jax.cache import Dense, init_cache
from rq_jax.cache import base


def dense_kv(model, tokens: Int[Array, "b t"], num_loops: int, **model_kwargs):
    """The looped slots' K and V [L, N, B, K, T, D] (float32) after a prefill of `tokens`."""
    cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], Dense("float32"), num_loops=num_loops)
    return model(tokens, cache, num_loops=num_loops, **model_kwargs).cache.dense_kv()


def reconstruction_error(fmt: base.CacheFormat, k: Float[Array, "l n b k s d"], v: Float[Array, "l n b k s d"],
                         calib: tuple[Any, ...] | None = None) -> dict[str, np.ndarray]:
    """Normalised squared error ‖X̂ − X‖² / ‖X‖² per loop for K and V [L, N, B, K, S, D].

    Returns {"k": [L], "v": [L]} (numpy), each summed over layers, batch, heads and tokens. `calib` has
    one entry per loop segment; when None the format is calibrated on these K/V (`calibrate`).
    """
    num_loops, num_layers, batch, heads, seq, dim = k.shape
    lengths = jnp.full((batch,), seq, jnp.int32)
    err = {"k": np.zeros(num_loops), "v": np.zeros(num_loops)}
    for i, seg in enumerate(base.segments(num_loops, fmt.group_len)):
        ks, vs = base.split_loops(k, seg), base.split_loops(v, seg)
        c = fmt.calibrate(seg, ks, vs, lengths) if calib is None else calib[i]
        state = fmt.write(fmt.init(seg, num_layers, batch, seq, heads, dim), ks, vs, jnp.zeros_like(lengths),
                          lengths, c)
        reconstruct = jax.jit(fmt.reconstruct, static_argnums=2)  # one compile per group position
        for g in range(seg.groups):
            for r in range(seg.size):
                loop = seg.start + g * seg.size + r
                for layer in range(num_layers):
                    hats = reconstruct(state, (jnp.int32(g), jnp.int32(layer)), r, lengths, c)
                    for name, ref, hat in (("k", k, hats[0]), ("v", v, hats[1])):
                        err[name][loop] += float(jnp.sum((hat - ref[loop, layer]) ** 2))
    for name, ref in (("k", k), ("v", v)):
        err[name] /= np.asarray(jnp.sum(ref.astype(jnp.float32) ** 2, axis=(1, 2, 3, 4, 5)))
    return err
