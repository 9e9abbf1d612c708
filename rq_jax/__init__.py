"""rq_jax: ResidualQuant in JAX — compressed KV caches for looped transformers (Ouro, Huginn)."""

from rq_jax.cache import KVCache, available_formats, get_format, init_cache
from rq_jax.config import ModelConfig, from_hf_config, preset
from rq_jax.models import LoopedLM, init_model, model_class
from rq_jax.nn.huginn import Huginn
from rq_jax.nn.ouro import ExitRule, Ouro
from rq_jax.sampling import Sampler, SamplingConfig

__all__ = ["ExitRule", "Huginn", "KVCache", "LoopedLM", "ModelConfig", "Ouro", "Sampler", "SamplingConfig",
           "available_formats", "from_hf_config", "get_format", "init_cache", "init_model", "model_class",
           "preset"]
