"""Offline, seeded training and evaluation data: addition, key–value retrieval, stdlib source text.

Splits ("train", "calib", "eval") never overlap: generated examples are assigned by a hash of their
canonical key (`common.split_of`), text by fixed module lists (`text.EVAL_MODULES`, `CALIB_MODULES`).
`Mixture(MixtureConfig(...)).batch(step)` is the deterministic, resumable training stream; `Tasks` the
held-out evaluation sets.
"""

from rq_jax.data.addition import Addition
from rq_jax.data.common import BYTE_OFFSET, EOS, SPLITS, TASKS, Example, collate, decode, encode, split_of, stream_rng
from rq_jax.data.mixture import Batch, Mixture, MixtureConfig
from rq_jax.data.retrieval import Retrieval
from rq_jax.data.tasks import Tasks
from rq_jax.data.text import CALIB_MODULES, EVAL_MODULES, StdlibText

__all__ = ["Addition", "BYTE_OFFSET", "Batch", "CALIB_MODULES", "EOS", "EVAL_MODULES", "Example", "Mixture",
           "MixtureConfig", "Retrieval", "SPLITS", "StdlibText", "TASKS", "Tasks", "collate", "decode", "encode",
           "split_of", "stream_rng"]
