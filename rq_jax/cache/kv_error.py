"""K/V reconstruction error of a cache format on a model's real K/V.

The model runs once with a dense float32 cache; the stored K/V of every (loop, layer) slot are then
encoded by the format in one `write` per loop segment and decoded with `reconstruct`, so the error is
the format's alone (no error feedback through later loops or tokens).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rq_jax.cache import base
from rq_jax.cache.dense import Dense
from rq_jax.cache.kv import init_cache
from rq_jax.cache.schemes import kv_error_labels, pick
from rq_jax.shapes import LoopPast, Tokens


def dense_kv(model, tokens: Tokens, num_loops: int, **model_kwargs):
    """The looped slots' K and V [L, N, B, K, T, D] (float32) after a prefill of `tokens`."""
    cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], Dense("float32"), num_loops=num_loops)
    return model(tokens, cache, num_loops=num_loops, **model_kwargs).cache.dense_kv()


def reconstruction_error(fmt: base.CacheFormat, k: LoopPast, v: LoopPast,
                         calib: tuple[Any, ...] | None = None) -> dict[str, np.ndarray]:
    """Normalised squared error ‖X̂ − X‖² / ‖X‖² of K and V [L, N, B, K, S, D].

    Returns numpy {"k": [L], "v": [L]} per loop (errors and norms summed over layers, batch, heads
    and tokens) and {"k_layer": [L, N], "v_layer": [L, N]} per (loop, layer). `calib` has one entry
    per loop segment; when None the format is calibrated on these K/V (`calibrate`).
    """
    num_loops, batch, seq = k.shape[0], k.shape[2], k.shape[4]
    lengths = jnp.full((batch,), seq, jnp.int32)
    err = {"k": [], "v": []}
    for i, seg in enumerate(base.segments(num_loops, fmt.group_len)):
        ks, vs = base.split_loops(k, seg), base.split_loops(v, seg)
        c = fmt.calibrate(seg, ks, vs, lengths) if calib is None else calib[i]
        for name, e in zip("kv", _segment_errors(fmt, seg, ks, vs, lengths, c)):
            err[name].append(np.asarray(e).reshape(-1, e.shape[-1]))  # [G, p, N] → [loops in order, N]
    out = {}
    for name, ref in (("k", k), ("v", v)):
        sq, norm = np.concatenate(err[name]), np.asarray(jnp.sum(ref.astype(jnp.float32) ** 2, axis=(2, 3, 4, 5)))
        out[name], out[f"{name}_layer"] = sq.sum(1) / norm.sum(1), sq / norm
    return out



def scheme_errors(k: LoopPast, v: LoopPast, group_size: int,
                  log=print) -> list[dict]:
    """`reconstruction_error` of every scheme of the K/V error report (`schemes.kv_error_labels` at
    `group_size`) on K/V [L, N, B, K, S, D]: rows of scheme, bits (per element at these loops and head
    dim), k_nmse, v_nmse (the mean over loops) and k/v_nmse_per_loop [L]. A format these shapes do not
    suit (e.g. a head dim not a power of 2) is left out with a line saying why; `log` gets the table as
    it fills."""
    loops, rows = k.shape[0], []
    log(f"{'scheme':30s} {'bits/elem':>9s} {'K NMSE':>9s} {'V NMSE':>9s}")
    for scheme in pick(kv_error_labels(group_size), (group_size,)):
        try:
            err = reconstruction_error(scheme.fmt, k, v)
        except ValueError as why:
            log(f"{scheme.label:30s} not for this model: {why}")
            continue
        row = dict(scheme=scheme.label, bits=float(scheme.fmt.bits_per_element(loops, k.shape[-1])),
                   k_nmse=float(err["k"].mean()), v_nmse=float(err["v"].mean()),
                   k_nmse_per_loop=err["k"].tolist(), v_nmse_per_loop=err["v"].tolist())
        rows.append(row)
        log(f"{scheme.label:30s} {row['bits']:9.4f} {row['k_nmse']:9.4f} {row['v_nmse']:9.4f}")
    return rows

@functools.partial(jax.jit, static_argnums=(0, 1))
def _segment_errors(fmt: base.CacheFormat, seg: base.Segment, ks, vs, lengths, calib):
    """Squared errors [G, p, N] of K and V after one `write` of a segment's K/V [G, p, N, B, K, S, D]:
    one compiled program per format and segment, slots visited with `lax.map`."""
    groups, size, num_layers, batch, heads, seq, dim = ks.shape
    state = fmt.write(fmt.init(seg, num_layers, batch, seq, heads, dim), ks, vs, jnp.zeros_like(lengths), lengths,
                      calib).state
    slots = jnp.stack(jnp.meshgrid(jnp.arange(groups), jnp.arange(num_layers), indexing="ij"), -1).reshape(-1, 2)
    out = []
    for r in range(size):
        def one(slot, r=r):
            g, n = slot[0], slot[1]
            k_hat, v_hat = fmt.reconstruct(state, (g, n), r, lengths, calib)
            return jnp.sum((k_hat - ks[g, r, n]) ** 2), jnp.sum((v_hat - vs[g, r, n]) ** 2)

        ek, ev = jax.lax.map(one, slots)
        out.append((ek.reshape(groups, num_layers), ev.reshape(groups, num_layers)))
    return tuple(jnp.stack([o[i] for o in out], axis=1) for i in (0, 1))


def loop_similarity(k: LoopPast, v: LoopPast, group_len: int
                    ) -> dict[str, np.ndarray]:
    """How close each loop's K/V [L, N, B, K, S, D] are to their group's last loop (the anchor a
    ResidualQuant cache with groups of `group_len` loops codes the others against), per (loop, layer):

        cos  mean over vectors (rows, heads, tokens) of cos(x_r, x_anchor)
        rel  ‖x_r − α·x_anchor‖ / ‖x_r‖ over all vectors, α the least-squares scale of each vector

    Returns numpy {"k_cos", "k_rel", "v_cos", "v_rel"}, each [L, N]; the anchor loops give 1 and 0."""
    num_loops = k.shape[0]
    anchor = np.zeros(num_loops, np.int32)
    for seg in base.segments(num_loops, group_len):
        for g in range(seg.groups):
            first = seg.start + g * seg.size
            anchor[first : first + seg.size] = first + seg.size - 1
    out = {}
    for name, x in (("k", k), ("v", v)):
        x = jnp.asarray(x, jnp.float32)
        a = x[anchor]
        dot, xx, aa = (jnp.sum(p * q, axis=-1) for p, q in ((x, a), (x, x), (a, a)))
        cos = dot / jnp.sqrt(jnp.maximum(xx * aa, 1e-30))
        alpha = dot / jnp.maximum(aa, 1e-30)
        resid = jnp.sum((x - alpha[..., None] * a) ** 2, axis=-1)
        out[f"{name}_cos"] = np.asarray(jnp.mean(cos, axis=(2, 3, 4)))
        norm = jnp.maximum(jnp.sum(xx, axis=(2, 3, 4)), 1e-30)
        out[f"{name}_rel"] = np.sqrt(np.asarray(jnp.sum(resid, axis=(2, 3, 4)) / norm))
    return out
