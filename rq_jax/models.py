"""Model classes by family, and random initialisation."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rq_jax.config import ModelConfig
from rq_jax.nn.huginn import Huginn
from rq_jax.nn.ouro import Ouro

LoopedLM = Ouro | Huginn


def model_class(config: ModelConfig) -> type[Ouro] | type[Huginn]:
    """`Ouro` or `Huginn`, by the config's family."""
    return {"ouro": Ouro, "huginn": Huginn}[config.family]


def init_model(config: ModelConfig, seed: int = 0, *, dtype=jnp.float32, param_dtype=jnp.float32) -> LoopedLM:
    """A randomly initialised model (norms at 1, weights N(0, init_std²))."""
    return model_class(config)(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
