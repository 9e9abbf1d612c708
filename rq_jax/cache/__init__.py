"""KV cache formats behind one protocol (`base.CacheFormat`), the model-level cache pytree, its
calibration and the per-call context that reads it.

Importing this package registers every format: dense, uniform, rotated, residual, kivi, residual_vq, share,
compress, turboquant.
"""

from rq_jax.cache.base import (CacheFormat, Partial, Segment, Written, available_formats, finalize, get_format, merge,
                               segments)
from rq_jax.cache.calib import CacheCalib, check_calib, default_calib, fit_calib
from rq_jax.cache.dense import Dense
from rq_jax.cache.kivi import Kivi
from rq_jax.cache.kv import CacheBytes, KVCache, cache_bytes, cache_nbytes, check_overflow, init_cache
from rq_jax.cache.loop_quant import LoopQuant, RotationCalib
from rq_jax.cache.residual_vq import ResidualVQ, RVQCalib
from rq_jax.cache.share import HuginnCompress, LoopShare
from rq_jax.cache.turboquant import TurboQuant

__all__ = ["CacheBytes", "CacheCalib", "CacheFormat", "Dense", "HuginnCompress", "KVCache", "Kivi", "LoopQuant",
           "LoopShare", "Partial", "RVQCalib", "ResidualVQ", "RotationCalib", "Segment", "TurboQuant", "Written",
           "available_formats", "cache_bytes", "cache_nbytes", "check_calib", "check_overflow", "default_calib",
           "finalize", "fit_calib", "get_format", "init_cache", "merge", "segments"]
