"""Training objectives of the tiny models: next-token NLL of the last loop, or Ouro's expected loss.

Ouro's pre-training objective (Zhu et al., "Scaling Latent Reasoning via Looped Language Models",
arXiv 2510.25741, §3.3 "Stage I: learning an entropy-regularized objective") scores *every* loop:

    L = Σ_t p_φ(t | x) · L^(t)  −  β · H(p_φ(· | x))

per token, where L^(t) is the next-token NLL of loop t's logits, p_φ the exit distribution of the
gate (`rq_jax.nn.ouro.exit_distribution`: λ_t = sigmoid(gate(h_t)), p_t = λ_t ∏_{s<t}(1 − λ_s), the
last loop taking the rest) and H its entropy. The entropy term is the KL to a uniform prior over
exit steps up to a constant (the paper's ELBO reading), which keeps the exit mass from collapsing
onto one loop. The paper's Table 1 sets β = 0.1 in Stage 1a and 0.05 from Stage 1b on (§4.3: "reduced β
from 0.1 in Stage 1a to 0.05 in later stages"); `TrainConfig.beta_at` follows that schedule. Every loop
must then predict the next token through the shared head, so the loops refine one state — the
regime in which ResidualQuant's residuals against the last loop are small.

The paper's Stage II (the gate alone trained toward exiting once a loop stops lowering the loss) is
not implemented: the shipped models exit at the last loop (`early_exit_threshold` 1.0), which Stage II
does not change.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

OBJECTIVES = ("last-loop", "ouro")


class LoopLoss(NamedTuple):
    """Per-token loss [B, T] and what it is made of: per-loop NLL [L, B, T], exit pdf [L, B, T],
    its entropy [B, T]."""

    loss: Float[Array, "b t"]
    nll: Float[Array, "l b t"]
    pdf: Float[Array, "l b t"]
    entropy: Float[Array, "b t"]


def ouro_loss(logits: Float[Array, "l b t v"], pdf: Float[Array, "l b t"], targets: Int[Array, "b t"],
              beta: float) -> LoopLoss:
    """Ouro's Stage I loss per token: Σ_t pdf_t · NLL_t − β·H(pdf), with NLL_t of logits[t] on targets.

    pdf is the exit distribution over the L loops (each [:, b, t] sums to 1); gradients reach every
    loop's logits through its NLL and the gate through pdf."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets[None])  # [L, B, T]
    entropy = -jnp.sum(pdf * jnp.log(jnp.maximum(pdf, 1e-30)), axis=0)
    return LoopLoss(jnp.sum(pdf * nll, axis=0) - beta * entropy, nll, pdf, entropy)
