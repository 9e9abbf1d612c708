"""rq_jax: ResidualQuant in JAX — compressed KV caches for looped transformers (Ouro, Huginn)."""

from rq_jax.cache import KVCache, available_formats, get_format, init_cache
from rq_jax.config import ModelConfig, from_hf_config, preset
from rq_jax.models import LoopedLM, init_model, model_class
from rq_jax.nn.huginn import Huginn
from rq_jax.nn.ouro import ExitRule, Ouro
from rq_jax.sampling import Generation, Sampler, SamplingConfig
from rq_jax.text import TextGenerator, generate

__all__ = ["ExitRule", "Generation", "Huginn", "KVCache", "LoopedLM", "ModelConfig", "Ouro", "Sampler",
           "SamplingConfig", "TextGenerator", "available_formats", "from_hf_config", "generate", "get_format",
           "init_cache", "init_model", "model_class", "preset"]
