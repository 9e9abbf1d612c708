"""OSCAR (App. G.1): rotations from attention-aware covariances, no gradients, float64 numpy.

Per (loop group, layer, kv head), statistics pooled over the group's loops, the kv head's query heads
(GQA) and every fit token:

    C_K = Qᵀ Q / N_q                     the queries that read the keys
    C_V = (S Z_V)ᵀ (S Z_V) / N_q          S = causal softmax(Q Kᵀ/√D) from the original Q and K

Z_V is what the format quantizes, taken unquantized: for a residual format the anchor loop's V and,
for every other loop, its least-squares residual V_r − α_r·V_p(r) against the *original* reference
(α per token, 1 without least squares; the reconstructed reference would make the rotation depend on
itself); for a direct format V itself. With C = B Λ Bᵀ (eigenvectors ordered by decreasing eigenvalue,
each signed so its largest-magnitude entry is positive), the paper's row-convention rotation is

    T = B · H · P,   U = Tᵀ (the cache's z = U x)

with H the normalised Hadamard matrix of `rq_jax.quant.rotation` and P the bit-reversal permutation
of the eigenvalue ranks: column j of B·H·P is column `bit_reversal(D)[j]` of B·H. The paper writes P
after H and does not say how bit reversal extends to sizes that are not powers of two; here it is the
pruned bit reversal (reverse ⌈log₂ D⌉ bits, skip values ≥ D). No key means.
"""

from __future__ import annotations

import numpy as np

from rq_jax.cache.base import Segment
from rq_jax.cache.loop_quant import LoopQuant, RotationCalib
from rq_jax.calibrate import losses
from rq_jax.calibrate.losses import SlotData
from rq_jax.quant import rotation


def bit_reversal(n: int) -> np.ndarray:
    """The pruned bit-reversal order of 0..n−1: i ↦ i with ⌈log₂ n⌉ bits reversed, values ≥ n skipped."""
    bits = max(1, (n - 1).bit_length())
    order = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return np.array([r for r in order if r < n], np.int64)


def hadamard64(n: int) -> np.ndarray:
    """The normalised Hadamard matrix of `rotation.hadamard`, exactly, in float64."""
    return np.sign(np.asarray(rotation.hadamard(n), np.float64)) / np.sqrt(n)


def eigenbasis(c: np.ndarray) -> np.ndarray:
    """Eigenvectors of a symmetric c [D, D] as columns, by decreasing eigenvalue, each signed so that
    its largest-magnitude entry is positive (a deterministic choice)."""
    w, b = np.linalg.eigh(c)
    b = b[:, np.argsort(-w, kind="stable")]
    lead = b[np.argmax(np.abs(b), axis=0), np.arange(b.shape[1])]
    return b * np.where(lead < 0, -1.0, 1.0)


def rotation_from_covariance(c: np.ndarray) -> np.ndarray:
    """OSCAR's U = (B·H·P)ᵀ [D, D] float64 for a covariance c [D, D]."""
    d = c.shape[0]
    t = (eigenbasis(c) @ hadamard64(d))[:, bit_reversal(d)]
    return t.T


def value_targets(fmt: LoopQuant, v: np.ndarray) -> np.ndarray:
    """Z_V [p, ..., D] of one group's values v [p, ..., D] (float64): see the module docstring."""
    if not fmt.residual:
        return v
    cfg = fmt.group_config(v.shape[0], "v")
    out = v.copy()
    for r in range(cfg.num_loops):
        if r == cfg.anchor:
            continue
        ref = v[cfg.parent(r)]
        alpha = 1.0
        if cfg.least_squares:
            den = np.sum(ref * ref, axis=-1, keepdims=True)
            ok = den > np.finfo(np.float32).tiny
            alpha = np.where(ok, np.sum(v[r] * ref, axis=-1, keepdims=True) / np.where(ok, den, 1.0), 0.0)
        out[r] = v[r] - alpha * ref
    return out


def covariances(fmt: LoopQuant, data: SlotData) -> tuple[np.ndarray, np.ndarray]:
    """C_K and C_V [S, K, D, D] (float64) of slot-layout data (all positions of every row)."""
    q, k, v = (np.asarray(x, np.float64) for x in (data.q, data.k, data.v))  # q [S, p, B, T, K, G, D]
    s_, p, rows, t, kv, g, d = q.shape
    count = p * rows * t * g
    c_k = np.einsum("spbtkgd,spbtkge->skde", q, q) / count
    c_v = np.zeros((s_, kv, d, d))
    causal = np.tril(np.ones((t, t), bool))
    for s in range(s_):
        z = value_targets(fmt, v[s])  # [p, B, K, T, D]
        for b in range(rows):
            scores = np.einsum("ptkgd,pksd->pkgts", q[s, :, b], k[s, :, b]) / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            sz = np.einsum("pkgts,pksd->pkgtd", probs, z[:, b])
            c_v[s] += np.einsum("pkgtd,pkgte->kde", sz, sz)
    return c_k, c_v / count


def fit_segment(fmt: LoopQuant, seg: Segment, fit: SlotData) -> RotationCalib:
    """OSCAR rotations of one segment ([G, N, K, D, D] for keys and values, float32), no key means."""
    c_k, c_v = covariances(fmt, fit)
    def rot(c):
        return np.stack([[rotation_from_covariance(x) for x in per_slot] for per_slot in c])
    return RotationCalib(*(losses.from_slots(rot(c).astype(np.float32), seg.groups) for c in (c_k, c_v)))
