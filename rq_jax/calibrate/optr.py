"""OptR-H (App. G.1): learned rotations T = H·expm(A − Aᵀ), fitted per (loop group, layer, kv head).

Recipe (spec §4), with the choices the paper leaves open made explicit:

- Parametrisation. In the cache's column convention z = U x, U = Tᵀ = expm(Aᵀ − A)·U₀ with U₀ the
  format's default rotation (the normalised Hadamard for `residual`/`rotated`), so A = 0 gives
  exactly the uncalibrated cache and the paper's H is U₀ᵀ (also a normalised Hadamard matrix).
  A is a full [D, D] float32 matrix per kv head, only its skew part matters.
- Keys first: L_K = KL(S ‖ Ŝ) + E((Ŝ − S)V), then values: L_V = E(Ŝ(V̂ − V)) with Ŝ from the chosen
  key rotation and means (`rq_jax.calibrate.losses`), each the mean over the group's loops and the
  kv head's query heads (GQA). Gradients pass the format's quantizer straight through (identity, the
  clip range, min/max and the FP8 metadata treated as constants; `rq_jax.quant.ste`) and are stopped
  through the reconstructed references; α is part of the stopped reconstruction.
- Optimiser: Adam (optax), lr 0.02, 80 steps, float32; each step the last 64 query positions of 2
  fit rows (rows visited in a seeded random order, reshuffled every pass), attending causally to all
  their keys. Every slot and kv head is independent (their losses are summed, Adam is elementwise),
  so all slots of a segment train in one vmapped step.
- Key means (when `key_means`): during training each loop's mean follows the rotation as U·μ₀, μ₀
  the means fitted for U₀ mapped back to the original basis (exact for the anchor); every candidate
  rotation then gets its own means fitted on the fit rows (`LoopQuant.fit_key_means`).
- Selection: per kv head, the candidate with the lowest holdout loss (all holdout rows, their last
  64 queries) among: keys — U₀ without means (the uncalibrated cache), U₀ with means, and the
  rotation at every `candidate_every`-th step and the last step, with means; values — U₀ and the same
  checkpoints. Ties keep the earlier candidate. So the calibrated keys are never worse than the
  uncalibrated ones on holdout, per head, and the values never worse than U₀ under the chosen keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array
from tqdm.auto import tqdm

from rq_jax.cache.base import Segment
from rq_jax.cache.loop_quant import LoopQuant, RotationCalib
from rq_jax.calibrate import losses
from rq_jax.calibrate.losses import SlotData
from rq_jax.quant import rotation

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class OptRHConfig:
    """OptR-H settings (defaults: the paper's Ouro settings)."""

    steps: int = 80
    lr: float = 0.02
    rows_per_step: int = 2
    query_len: int = 64
    candidate_every: int = 20
    key_means: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "rows_per_step", "query_len", "candidate_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"OptR-H {name} must be ≥ 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"OptR-H lr must be positive, got {self.lr}")

    def candidate_steps(self) -> tuple[int, ...]:
        """The steps whose rotations are selection candidates: every `candidate_every`-th and the last."""
        return tuple(sorted({*range(self.candidate_every, self.steps + 1, self.candidate_every), self.steps}))


def learned(a: Array, u0: Array) -> Array:
    """U = expm(Aᵀ − A)·U₀ for a, u0 [..., D, D]: the transpose of the paper's T = U₀ᵀ·expm(A − Aᵀ)."""
    d = a.shape[-1]
    t = jax.vmap(rotation.learned_rotation)(a.reshape(-1, d, d), jnp.swapaxes(u0, -1, -2).reshape(-1, d, d))
    return jnp.swapaxes(t, -1, -2).reshape(a.shape)


def _rotated_means(u: Array, mean0: Array | None) -> Array | None:
    """Means U·μ₀ [p, K, D] for original-basis means μ₀ [p, K, D]."""
    return None if mean0 is None else jnp.einsum("kde,pke->pkd", u, mean0, precision=_HI)


@functools.partial(jax.jit, static_argnames=("fmt", "query_len", "d_model", "lr"))
def _key_step(a, opt_state, data: SlotData, rows, u0, mean0, *, fmt, query_len, d_model, lr):
    def total(a):
        def slot(a, data, u0, mean0):
            u = learned(a, u0)
            w = losses.window(data, rows, query_len)
            return jnp.sum(losses.slot_key_loss(fmt, w, u, _rotated_means(u, mean0), d_model))

        return jnp.sum(jax.vmap(slot)(a, data, u0, mean0))

    loss, grad = jax.value_and_grad(total)(a)
    updates, opt_state = optax.adam(lr).update(grad, opt_state, a)
    return optax.apply_updates(a, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("fmt", "query_len", "d_model", "lr"))
def _value_step(a, opt_state, data: SlotData, rows, u0, u_k, mean, *, fmt, query_len, d_model, lr):
    def total(a):
        def slot(a, data, u0, u_k, mean):
            w = losses.window(data, rows, query_len)
            return jnp.sum(losses.slot_value_loss(fmt, w, u_k, mean, learned(a, u0), d_model))

        return jnp.sum(jax.vmap(slot)(a, data, u0, u_k, mean))

    loss, grad = jax.value_and_grad(total)(a)
    updates, opt_state = optax.adam(lr).update(grad, opt_state, a)
    return optax.apply_updates(a, updates), opt_state, loss


_holdout = jax.jit(losses.holdout_losses, static_argnames=("fmt", "query_len", "d_model"))
_key_means = jax.jit(lambda fmt, k, lengths, rot: fmt.fit_key_means(k, lengths, rot), static_argnums=0)
_learned = jax.jit(learned)


def _row_order(rows: int, config: OptRHConfig) -> np.ndarray:
    """Rows of each step [steps, rows_per_step]: seeded permutations of the fit rows, back to back."""
    rng = np.random.default_rng(config.seed)
    need = config.steps * config.rows_per_step
    order = np.concatenate([rng.permutation(rows) for _ in range(-(-need // rows))])[:need]
    return order.reshape(config.steps, config.rows_per_step).astype(np.int32)


def _train(step, a0, data: SlotData, extra: tuple, config: OptRHConfig, fmt, query_len, d_model, bar, what):
    """Adam on A from a0; returns the A of every candidate step [C, S, K, D, D] and the step losses."""
    a, state = a0, optax.adam(config.lr).init(a0)
    keep, history, kept = [], [], set(config.candidate_steps())
    for i, rows in enumerate(_row_order(data.k.shape[2], config)):
        a, state, loss = step(a, state, data, jnp.asarray(rows), *extra, fmt=fmt, query_len=query_len,
                              d_model=d_model, lr=config.lr)
        history.append(float(loss))
        if i + 1 in kept:
            keep.append(a)
        if bar is not None:
            bar.set_postfix_str(f"{what} loss {history[-1]:.4g}")
            bar.update(1)
    return jnp.stack(keep), history


def fit_segment(fmt: LoopQuant, seg: Segment, fit: SlotData, holdout: SlotData, d_model: int,
                config: OptRHConfig = OptRHConfig(), progress: bool = False,
                label: str = "") -> tuple[RotationCalib, dict]:
    """OptR-H rotations (and key means) of one segment from slot-layout fit and holdout data.

    Returns the segment's `RotationCalib` ([G, N, ...]) and a report of numpy arrays [G, N, K]:
    holdout losses before (U₀, no means) and after, the chosen candidate per head, every candidate's
    holdout loss [C, G, N, K], and the training loss per step.
    """
    groups = seg.groups
    s, p, rows, kv, t, d = fit.k.shape
    num_layers = s // groups
    query_len = min(config.query_len, t, holdout.k.shape[4])
    default = fmt.default_calib(seg, num_layers, kv, d)
    u0_k, u0_v = losses.to_slots(default.key_rot), losses.to_slots(default.value_rot)
    fit_keys = losses.keys_by_segment(fit, groups)
    lengths = jnp.full((rows,), t, jnp.int32)
    mean_for = (lambda u: losses.to_slots(_key_means(fmt, fit_keys, lengths, losses.from_slots(u, groups)))) \
        if config.key_means else (lambda u: None)  # [S, p, K, D] per rotation [S, K, D, D]
    holdout_for = functools.partial(_holdout, fmt, holdout, query_len=query_len, d_model=d_model)

    bar = tqdm(total=2 * config.steps, desc=f"OptR-H {label}".strip(), leave=False) if progress else None
    zeros = jnp.zeros_like(u0_k)
    mean0 = mean_for(u0_k)
    mean0_orig = None if mean0 is None else jnp.einsum("skde,spkd->spke", u0_k, mean0, precision=_HI)
    a_keys, key_history = _train(_key_step, zeros, fit, (u0_k, mean0_orig), config, fmt, query_len, d_model,
                                 bar, "key")

    # Key candidates: U₀ without means (zero means: the same codes, one compiled program), U₀ with
    # means, each checkpoint with its means.
    cands = [(u0_k, None)] if mean0 is None else [(u0_k, jnp.zeros_like(mean0)), (u0_k, mean0)]
    cands += [(u, mean_for(u)) for u in _learned(a_keys, jnp.broadcast_to(u0_k, a_keys.shape))]
    key_labels = ["default"] + (["default+means"] if config.key_means else []) + \
        [f"step {i}" for i in config.candidate_steps()]
    evals = [holdout_for(u, m, u0_v) for u, m in cands]
    key_losses = np.stack([np.asarray(e[0]) for e in evals])  # [C, S, K]
    key_pick = np.argmin(key_losses, axis=0)  # first minimum: ties keep the earlier candidate
    def pick(xs, choice):
        return jnp.stack(xs)[choice, np.arange(s)[:, None], np.arange(kv)[None, :]]
    u_k = pick([u for u, _ in cands], key_pick)
    mean = None
    if config.key_means:  # [S, p, K, D], zeros where the chosen candidate has none
        mean = jnp.moveaxis(pick([jnp.moveaxis(m, 2, 1) for _, m in cands], key_pick), 1, 2)

    a_values, value_history = _train(_value_step, zeros, fit, (u0_v, u_k, mean), config, fmt, query_len,
                                     d_model, bar, "value")
    if bar is not None:
        bar.close()
    v_cands = [u0_v] + list(_learned(a_values, jnp.broadcast_to(u0_v, a_values.shape)))
    value_losses = np.stack([np.asarray(holdout_for(u_k, mean, u)[1]) for u in v_cands])  # [C, S, K]
    value_pick = np.argmin(value_losses, axis=0)
    value_labels = ["default"] + [f"step {i}" for i in config.candidate_steps()]
    u_v = pick(v_cands, value_pick)

    def gather(x, choice):
        return np.take_along_axis(x, choice[None], axis=0)[0]
    def unslot(x):
        return np.asarray(x).reshape(*x.shape[:-2], groups, num_layers, kv)
    report = dict(
        key_before=unslot(key_losses[0]), key_after=unslot(gather(key_losses, key_pick)),
        value_before=unslot(np.asarray(evals[0][1])), value_after=unslot(gather(value_losses, value_pick)),
        key_choice=unslot(key_pick), value_choice=unslot(value_pick),
        key_candidates=unslot(key_losses), value_candidates=unslot(value_losses),
        key_candidate_labels=key_labels, value_candidate_labels=value_labels,
        key_train_loss=np.asarray(key_history), value_train_loss=np.asarray(value_history))
    calib = RotationCalib(losses.from_slots(u_k, groups), losses.from_slots(u_v, groups),
                          None if mean is None else losses.from_slots(mean, groups))
    return calib, report
