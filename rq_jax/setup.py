"""One way to set a model up for generation through a cache format, shared by the Sampler, the eval loops'
`CacheScorer` and the serving engine's model runner: the parameters split from the module and sharded over a
mesh, the loop count every model call and cache agrees on, and the calibration (the formats' defaults when
none is given and none needs fitting), sharded beside them. Each user then builds its own caches and
compiled programs (with the cache donated) on top, jitted by `jit`."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh

from rq_jax import sharding
from rq_jax.cache import attention
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.calib import CacheCalib, default_calib
from rq_jax.cache.kv import init_cache
from rq_jax.nn import common


class Prepared(NamedTuple):
    """A model ready for generation: its graph, its parameters (sharded on the mesh), the loops (Ouro) or
    recurrence steps (Huginn) of every call, the calibration (None: the formats need it fitted on data
    first, `needs_data`), sharded like the cache it goes with."""

    graphdef: Any
    params: Any
    num_loops: int
    calib: CacheCalib | None
    needs_data: bool


def jit(fn, **kwargs):
    """`jax.jit(fn, **kwargs)` for a program that runs on this host's default backend: the kernel ops' "auto"
    traces only that backend's implementations (`attention.for_host`), not every platform's."""
    return jax.jit(attention.for_host(fn), **kwargs)


def num_loops(config, model_kwargs: Mapping[str, Any]) -> int:
    """The loops a model runs under `model_kwargs`: `num_loops` (or Huginn's `num_steps`) when given, else the
    config's."""
    given = [model_kwargs[k] for k in ("num_loops", "num_steps") if model_kwargs.get(k) is not None]
    return int(given[0]) if given else config.num_loops


def splits_layers(mesh: Mesh | None = None, platform: str | None = None) -> bool:
    """Whether generation on `platform` (default: the host's backend) runs each layer's weights as arrays of
    their own (`common.per_layer`): on one CPU device, where XLA copies a layer out of a stacked weight at
    every step. GPU and TPU programs keep the stacks (and one compiled layer; their copies not measured)."""
    return mesh is None and (platform or jax.default_backend()) == "cpu"


def weights(model, mesh: Mesh | None = None) -> tuple[Any, Any]:
    """`model` split for generation: (graphdef, params), the params placed by `sharding.shard_state`. Where
    `splits_layers`, each layer's weights are copied out of their stacks here, once, so they are held twice
    while the caller keeps `model`."""
    if splits_layers(mesh):
        model = common.per_layer(model)
    graphdef, params = nnx.split(model)
    return graphdef, sharding.shard_state(params, model.config, mesh)


def prepare(model, fmt: CacheFormat, plain_fmt: CacheFormat | None = None, *, calib: CacheCalib | None = None,
            mesh: Mesh | None = None, **model_kwargs) -> Prepared:
    """`model` set up for generation with a cache of `fmt` (`plain_fmt` for Huginn's prelude and coda, default
    `fmt`) under `model_kwargs` (`num_loops`/`num_steps`): its `weights`, `calib` or the formats' `default_calib`
    (built once, abstractly) by `sharding.shard_calib`."""
    plain_fmt = plain_fmt or fmt
    graphdef, params = weights(model, mesh)
    loops = num_loops(model.config, model_kwargs)
    needs_data = fmt.needs_data or plain_fmt.needs_data
    if calib is None and not needs_data:
        calib = default_calib(jax.eval_shape(
            lambda: init_cache(model.config, 1, 1, fmt, num_loops=loops, plain_fmt=plain_fmt)))
    return Prepared(graphdef, params, loops, sharding.shard_calib(calib, mesh, fmt, plain_fmt), needs_data)
