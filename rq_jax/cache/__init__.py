"""KV cache formats behind one protocol, and the model-level cache pytree.

Importing this package registers every format: dense, uniform, rotated, residual, kivi, residual_vq.
"""

from rq_jax.cache.base import CacheFormat, Partial, Segment, available_formats, finalize, get_format, merge, segments
from rq_jax.cache.dense import Dense
from rq_jax.cache.kivi import Kivi
from rq_jax.cache.kv import (CacheCalib, KVCache, cache_nbytes, calibrate, check_overflow, default_calib,
                             dense_equivalent_nbytes, init_cache)
from rq_jax.cache.residual import LoopQuant, RotationCalib
from rq_jax.cache.residual_vq import ResidualVQ, RVQCalib

__all__ = ["CacheCalib", "CacheFormat", "Dense", "KVCache", "Kivi", "LoopQuant", "Partial", "RVQCalib",
           "ResidualVQ", "RotationCalib", "Segment", "available_formats", "cache_nbytes", "calibrate", "check_overflow",
           "default_calib", "dense_equivalent_nbytes", "finalize", "get_format", "init_cache", "merge", "segments"]
