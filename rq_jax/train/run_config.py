"""What a training run is: the tiny model configs and `TrainConfig` (everything that decides the loss
trajectory; a resumed run must have the same one)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from rq_jax.config import ModelConfig
from rq_jax.data import MixtureConfig
from rq_jax.train.objectives import OBJECTIVES

VOCAB = 259  # byte_level_tokenizer(): 3 specials + 256 bytes


def tiny_model_config(family: str, **overrides) -> ModelConfig:
    """The shipped tiny model of `family`: head_dim 64, ≤ 5 MB in bf16.

    ouro: hidden 256, 4 heads, 2 layers × 4 loops, MLP 512 (1.45 M params, 2.9 MB bf16).
    huginn: hidden 192, 3 heads, prelude 1 + core 2 × 8 steps + coda 1, MLP 512 (1.89 M, 3.8 MB bf16).
    """
    if family == "ouro":
        base = dict(family="ouro", vocab_size=VOCAB, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
                    head_dim=64, intermediate_size=512, num_loops=4, max_position_embeddings=2048,
                    rope_theta=10000.0, init_std=0.02)
    elif family == "huginn":
        hidden = overrides.get("hidden_size", 192)
        base = dict(family="huginn", vocab_size=VOCAB, hidden_size=hidden, num_layers=2, num_heads=hidden // 64,
                    num_kv_heads=hidden // 64, head_dim=64, intermediate_size=512, num_loops=8,
                    max_position_embeddings=2048, rope_theta=50000.0, tie_word_embeddings=True, num_prelude=1,
                    num_coda=1, qk_bias=True, embed_scale=hidden**0.5, init_std=(2 / (5 * hidden)) ** 0.5)
    else:
        raise ValueError(f"unknown family {family!r}: expected 'ouro' or 'huginn'")
    base.update(overrides)
    return ModelConfig(**base)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model, data mixture, optimizer and seed: a run's whole trajectory is a function of this.

    The learning rate warms up linearly from 0 to `lr` over `warmup_steps`, then follows a cosine to
    `lr * final_lr_frac` at `total_steps`. AdamW (b1, b2, weight decay on ≥ 2-D params only) after
    global-norm clipping at `clip_norm`. The loss is Σ_task task_weights[t] · (mean per-token loss of
    task t's weighted tokens) / Σ task_weights, the per-token loss given by `objective`.
    """

    model: ModelConfig
    data: MixtureConfig = MixtureConfig()
    loops: int | None = None  # loops (Ouro) / recurrence steps (Huginn) in training; None: the model's
    lr: float = 1e-3
    warmup_steps: int = 200
    total_steps: int = 20000
    final_lr_frac: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    task_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    seed: int = 0
    #: Huginn: start each training forward's recurrence from the reference's random initial state
    #: (seeded by step), as Huginn was trained, so the model works from zeros or from noise at
    #: inference. Ignored for Ouro.
    random_state: bool = True
    #: Re-initialise the token embedding [vocab, hidden] as N(0, embed_std²) (None: the model's init_std).
    #: Ouro adds unit-RMS normed branch outputs to the embedding, so a 0.02 embedding is drowned at init.
    embed_std: float | None = None
    #: Ouro: initialise the norms on each branch's output (`input_layernorm_2`, `post_attention_layernorm_2`)
    #: to this weight instead of 1 (None: 1), so every layer starts as a small update of a state the
    #: loops share (layer-scale style); the loops' K/V then start alike and the training decides how far
    #: they drift apart.
    branch_norm_init: float | None = None
    #: Ouro: at the switch from one loop to `num_loops` (step `one_loop_steps`), multiply the branch-output
    #: norms by this factor (None: leave them), so that a circuit formed through one loop continues as
    #: `num_loops` smaller updates of one shared state (1 / num_loops: the one-loop update split evenly).
    branch_norm_switch: float | None = None
    #: The first `one_loop_steps` steps run one loop (one recurrence step), the rest `num_loops`: the
    #: retrieval circuit (an induction head) forms within a few hundred steps through one loop but
    #: stays at chance for a thousand through four, and survives the switch after a brief dip.
    one_loop_steps: int = 0
    #: Start from the weights of this exported model folder (`--export` of an earlier run) instead of
    #: the seeded init: a second training stage, with a fresh optimizer and schedule from step 0.
    init_weights: str | None = None
    #: "last-loop": next-token NLL of the last loop's logits. "ouro" (Ouro only): Ouro's pre-training
    #: loss, every loop's NLL weighted by the exit distribution minus β × its entropy
    #: (`rq_jax.train.objectives.ouro_loss`), β = `entropy_beta` before step `entropy_beta_switch` and
    #: `entropy_beta_late` from it on — the Ouro paper's 0.1 in its Stage 1a and 0.05 in every later
    #: stage, Stages 1a and 1b being equally long (None: total_steps // 2).
    objective: str = "last-loop"
    entropy_beta: float = 0.1
    entropy_beta_late: float = 0.05
    entropy_beta_switch: int | None = None

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}: expected one of {', '.join(OBJECTIVES)}")
        if self.objective == "ouro" and self.model.family != "ouro":
            raise ValueError(f"the 'ouro' objective needs an Ouro model (its exit gate), got {self.model.family!r}")
        if self.branch_norm_init is not None and (self.model.family != "ouro" or not self.branch_norm_init > 0):
            raise ValueError(f"branch_norm_init needs an Ouro model and a value > 0, got {self.branch_norm_init!r} "
                             f"for {self.model.family!r}")
        if self.branch_norm_switch is not None and (self.model.family != "ouro" or not self.one_loop_steps
                                                    or not self.branch_norm_switch > 0):
            raise ValueError(f"branch_norm_switch needs an Ouro model, one_loop_steps > 0 and a value > 0, got "
                             f"{self.branch_norm_switch!r} for {self.model.family!r} with {self.one_loop_steps}")
        if min(self.entropy_beta, self.entropy_beta_late) < 0:
            raise ValueError(f"the entropy weights must be ≥ 0, got {self.entropy_beta} and {self.entropy_beta_late}")

    def beta_at(self, step):
        """β of the ouro objective at `step` (a Python or traced integer)."""
        switch = self.total_steps // 2 if self.entropy_beta_switch is None else self.entropy_beta_switch
        return jnp.where(step < switch, self.entropy_beta, self.entropy_beta_late)

    @property
    def num_loops(self) -> int:
        return self.loops or self.model.num_loops

    def loops_at(self, step: int) -> int:
        """Loops the training forward of `step` runs."""
        return 1 if step < self.one_loop_steps else self.num_loops

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "TrainConfig":
        raw = dict(raw)
        raw["task_weights"] = tuple(raw["task_weights"])
        return cls(model=ModelConfig(**raw.pop("model")), data=MixtureConfig.from_json(raw.pop("data")), **raw)


def diff(a: TrainConfig, b: TrainConfig) -> list[str]:
    """Flattened fields that differ between two configs, as "field: a != b"."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out
    fa, fb = flat(a.to_json()), flat(b.to_json())
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]

