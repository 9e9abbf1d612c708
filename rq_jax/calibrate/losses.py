"""The calibration losses of App. G.1, per kv head of one slot (a loop group of one layer).

For a loop r of the group, a query head h sharing kv head k, and the query window (the last `tq`
positions of each row, attending causally to every key of the row):

    S = softmax(Q Kᵀ/√D),  Ŝ = softmax(Q K̂ᵀ/√D)              (K̂: the format's reconstruction)
    L_K = KL(S ‖ Ŝ) averaged over queries  +  E((Ŝ − S) V)
    L_V = E(Ŝ (V̂ − V))                                        (Ŝ from the chosen key rotation, fixed)
    E(Δ) = ‖Δ W_O,h‖²_F / (N_q · d_model) = tr(Δ M_h Δᵀ) / (N_q · d_model),  M_h = W_O,h W_O,hᵀ

averaged over the group's loops and over the query heads of kv head k (GQA: they share the kv head's
rotation), giving one loss per kv head. Reconstructions go through the format's own `fake_quant`, so
gradients are straight-through with the references stopped (`rq_jax.quant.ste`).

Slot shapes: p loops in the group · b rows · tq query positions · T keys · K kv heads · G query heads
per kv head · D head dim. `SlotData` holds q [p, b, T, K, G, D], k and v [p, b, K, T, D] and the metric
m [K, G, D, D]; a leading slot axis S is added when slots are batched.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rq_jax.cache.loop_quant import LoopQuant, RotationCalib

_HI = jax.lax.Precision.HIGHEST
_NEG = -1e30


class SlotData(NamedTuple):
    """One slot's (or, with a leading S axis, several slots') calibration activations and metric."""

    q: Float[Array, "p b t k r d"]
    k: Float[Array, "p b k t d"]
    v: Float[Array, "p b k t d"]
    m: Float[Array, "k r d d"]


def reconstruct(fmt: LoopQuant, x: Float[Array, "p b k t d"], u: Float[Array, "k d d"],
                mean: Float[Array, "p k d"] | None, kind: str) -> Float[Array, "p b k t d"]:
    """What `fmt` stores and reads back for one slot's keys (kind "k") or values ("v") under rotation u
    (z = u x) and key means (rotated basis), with straight-through gradients (references stopped)."""
    calib = RotationCalib(u[None, None], u[None, None], None if mean is None else mean[None, None])
    k_hat, v_hat = fmt.fake_quant(x[None, :, None], x[None, :, None], calib)
    return (k_hat if kind == "k" else v_hat)[0, :, 0]


def log_probs(q: Float[Array, "p b t k r d"], k: Float[Array, "p b k s d"]) -> Float[Array, "p b k r t s"]:
    """Causal attention log-probabilities of the last t positions of each row over all s keys."""
    t, s = q.shape[2], k.shape[3]
    scores = jnp.einsum("pbtkgd,pbksd->pbkgts", q, k, precision=_HI) * q.shape[-1] ** -0.5
    mask = jnp.arange(s)[None, :] <= (s - t + jnp.arange(t))[:, None]
    return jax.nn.log_softmax(jnp.where(mask, scores, _NEG), axis=-1)


def _output_error(delta: Float[Array, "p b k r t d"], m: Float[Array, "k r d d"], d_model: int) -> Float[Array, "k"]:
    """E(Δ) per kv head: Σ tr(Δ M Δᵀ) / (N_q · d_model), averaged over loops and query heads."""
    p, b, _, g, t, _ = delta.shape
    err = jnp.einsum("pbkgtd,kgde,pbkgte->k", delta, m, delta, precision=_HI)
    return err / (p * b * g * t * d_model)


def key_loss(q, k, v, k_hat, m, d_model: int) -> Float[Array, "k"]:
    """L_K per kv head: KL(S ‖ Ŝ) averaged over queries plus E((Ŝ − S) V)."""
    ls, lh = log_probs(q, k), log_probs(q, k_hat)
    s, sh = jnp.exp(ls), jnp.exp(lh)
    p, b, _, g, t, _ = ls.shape
    kl = jnp.sum(jnp.where(s > 0, s * (ls - lh), 0.0), axis=(0, 1, 3, 4, 5)) / (p * b * g * t)
    delta = jnp.einsum("pbkgts,pbksd->pbkgtd", sh - s, v, precision=_HI)
    return kl + _output_error(delta, m, d_model)


def value_loss(probs, v, v_hat, m, d_model: int) -> Float[Array, "k"]:
    """L_V per kv head: E(Ŝ (V̂ − V)) for fixed attention probabilities Ŝ [p, b, K, G, t, s]."""
    delta = jnp.einsum("pbkgts,pbksd->pbkgtd", probs, v_hat - v, precision=_HI)
    return _output_error(delta, m, d_model)


def window(data: SlotData, rows: Array, query_len: int) -> SlotData:
    """`rows` of a slot's data, queries cut to the last `query_len` positions."""
    def take(x, axis):
        return jnp.take(x, rows, axis=axis)
    q = take(data.q, 1)
    return SlotData(q[:, :, q.shape[2] - query_len :], take(data.k, 1), take(data.v, 1), data.m)


def slot_key_loss(fmt: LoopQuant, data: SlotData, u: Array, mean: Array | None, d_model: int) -> Float[Array, "k"]:
    """L_K per kv head of a slot (data already windowed) for key rotation u [K, D, D] and means."""
    return key_loss(data.q, data.k, data.v, reconstruct(fmt, data.k, u, mean, "k"), data.m, d_model)


def slot_value_loss(fmt: LoopQuant, data: SlotData, u_k: Array, mean: Array | None, u_v: Array,
                    d_model: int) -> Float[Array, "k"]:
    """L_V per kv head of a slot: Ŝ from the keys under (u_k, mean), held fixed; values under u_v."""
    k_hat = jax.lax.stop_gradient(reconstruct(fmt, data.k, u_k, mean, "k"))
    probs = jnp.exp(log_probs(data.q, k_hat))
    return value_loss(probs, data.v, reconstruct(fmt, data.v, u_v, None, "v"), data.m, d_model)


def holdout_losses(fmt: LoopQuant, data: SlotData, u_k: Array, mean: Array | None, u_v: Array,
                   query_len: int, d_model: int) -> tuple[Float[Array, "s k"], Float[Array, "s k"]]:
    """(L_K, L_V) [S, K] of slot-batched data [S, ...] over all its rows (one row at a time), each
    row's last `query_len` queries; rotations [S, K, D, D], means [S, p, K, D] or None."""
    rows = data.k.shape[2]

    def one_slot(data, u_k, mean, u_v):
        def one_row(i):
            w = window(data, i[None], query_len)
            return (slot_key_loss(fmt, w, u_k, mean, d_model),
                    slot_value_loss(fmt, w, u_k, mean, u_v, d_model))

        lk, lv = jax.lax.map(one_row, jnp.arange(rows))
        return jnp.mean(lk, axis=0), jnp.mean(lv, axis=0)

    return jax.vmap(one_slot)(data, u_k, mean, u_v)


def segment_slots(q: Array, k: Array, v: Array, metric: Array, groups: int, size: int) -> SlotData:
    """A segment's activations in slot layout: q [G·p, N, B, T, H, D], k and v [G·p, N, B, K, T, D]
    (the segment's loops), metric [N, H, D, D] → `SlotData` with a leading S = G·N axis (group major)."""
    n, b, kv, t, d = k.shape[1:]
    per_kv = q.shape[-2] // kv
    qs = q.reshape(groups, size, n, b, t, kv, per_kv, d).transpose(0, 2, 1, 3, 4, 5, 6, 7)
    kvs = [x.reshape(groups, size, n, b, kv, t, d).transpose(0, 2, 1, 3, 4, 5, 6) for x in (k, v)]
    m = jnp.broadcast_to(metric.reshape(n, kv, per_kv, d, d), (groups, n, kv, per_kv, d, d))
    def flat(x):
        return x.reshape(groups * n, *x.shape[2:])
    return SlotData(flat(qs), flat(kvs[0]), flat(kvs[1]), flat(m))


def to_slots(x: Array) -> Array:
    """[G, N, ...] → [G·N, ...]."""
    return x.reshape(-1, *x.shape[2:])


def from_slots(x: Array, groups: int) -> Array:
    """[G·N, ...] → [G, N, ...]."""
    return x.reshape(groups, -1, *x.shape[1:])


def keys_by_segment(data: SlotData, groups: int) -> Array:
    """Slot-layout keys [G·N, p, B, K, T, D] → the cache formats' segment layout [G, p, N, B, K, T, D]."""
    return jnp.swapaxes(from_slots(data.k, groups), 1, 2)
