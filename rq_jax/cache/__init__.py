"""KV cache formats behind one protocol, and the model-level cache pytree."""

from rq_jax.cache.base import CacheFormat, Partial, available_formats, finalize, get_format, merge
from rq_jax.cache.dense import Dense
from rq_jax.cache.kivi import Kivi  # noqa: F401  (registers "kivi")
from rq_jax.cache.residual import LoopQuant, RotationCalib
from rq_jax.cache.residual_vq import ResidualVQ, RVQCalib, RVQState
from rq_jax.cache.kv import CacheCalib, KVCache, calibrate, dense_equivalent_nbytes, init_cache

__all__ = ["CacheCalib", "CacheFormat", "Dense", "LoopQuant", "KVCache", "Partial", "RotationCalib", "ResidualVQ", "RVQCalib", "RVQState", "available_formats", "calibrate", "dense_equivalent_nbytes",
           "finalize", "get_format", "init_cache", "merge"]
