"""Partition specs for parameters, caches and calibration, and running them on a `jax.sharding.Mesh`.

A mesh has up to two axes: `data` (batch rows) and `model` (kv heads and MLP channels, tensor
parallel). Every rule falls back to replication where an axis does not divide what it would split, and
`describe` says where it did. JAX's own machinery does the work: `NamedSharding`s on the inputs,
`with_sharding_constraint` on the outputs of the compiled steps, and XLA's partitioner in between.

    mesh = parse_mesh("data=4,model=2")                 # or None: one device, nothing changes
    model = shard_model(model, mesh)                    # params [.., heads·D] split over `model`
    cache = init_sharded_cache(model.config, batch, max_len, fmt, mesh)   # built in place, no gather
    calib = shard_calib(default_calib(cache), mesh, fmt)   # rotations split by kv head
    tokens = put(tokens_np, batch_sharding(mesh, tokens_np.shape))

Parameters (`param_specs`; L layers, E hidden, H heads, K kv heads, D head dim, I MLP width, V vocab):
  Ouro  q_proj [L, E, H·D], k_proj/v_proj [L, E, K·D] → P(None, None, model); o_proj [L, H·D, E] →
        P(None, model, None): each device holds whole kv heads and the query heads that read them
        (H = K·g, heads kv-major, so a contiguous split of H·D follows the kv heads).
        gate/up [L, E, I] → P(None, None, model), down [L, I, E] → P(None, model, None).
  Huginn proj [L, H·D, E] → P(None, model, None); qk_bias [L, 2, 1, H, D] → heads over model;
        mlp.proj [L, I, E] → P(None, model, None). The fused projections Wqkv [L, E, (H+2K)·D] and
        fc [L, E, 2I] stay replicated: their output axis concatenates q|k|v (a|b), so a contiguous
        split would not follow heads (channels); each device slices its heads out of the full product.
  lm_head [E, V] → P(None, model) when `model` divides V. Embeddings and norms are replicated.
  Heads go over `model` only when it divides K (GQA-aware); otherwise attention and the cache are
  replicated over `model` and only the MLP and head are split.

Cache (`cache_specs`): every state leaf is [G, N, B, K, S, ...] (codes, scales, offsets, α, KIVI's
  buffers alike) → P(None, None, data, model); the per-row counters [B] (`lengths`, `overflow`, ...)
  → P(data). `data` needs B divisible by its size, else the rows are replicated. The compiled decode
  step then gathers nothing of the cache: its only all-gathers move per-token data (the new tokens'
  K/V or codes on their way into the row-split cache, scatter indices, the argmax over a vocab-split
  head).
Calibration (`calib_specs`): rotations [G, N, K, D, D] and RVQ scales [G, N, K, D] split K (axis 2),
  key means [G, N, p, K, D] split axis 3; codebooks [G, N, c, g] and anything unknown are replicated.

Multi-process (`init_distributed`): one process per host, started with JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID; every process runs the same program on global arrays.
`put` builds global arrays from host values every process holds; `put_process_local` from each
process's own rows (`process_rows`); `to_host` brings results back as numpy on every process.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from rq_jax.cache.base import CacheFormat
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv import KVCache, init_cache
from rq_jax.config import ModelConfig

log = logging.getLogger(__name__)

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
Specs = Any  # a pytree of PartitionSpec with the structure of the tree it describes

# ---- processes and meshes ----------------------------------------------------------------------


def init_distributed(env: dict[str, str] | None = None) -> bool:
    """`jax.distributed.initialize` from JAX_COORDINATOR_ADDRESS ("host:port"), JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (optional JAX_LOCAL_DEVICE_IDS "0,1"); a no-op returning False when they are not
    set. Call before anything touches a device (calling again once initialised returns True). On CPU
    it selects gloo collectives (needed across processes). Raises ValueError when only some of the
    variables are set."""
    env = os.environ if env is None else env
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    given = [n for n in names if env.get(n)]
    if not given:
        return False
    if len(given) != len(names):
        raise ValueError(f"multi-process run needs all of {names}; got only {given}")
    if jax.distributed.is_initialized():
        return True
    local = env.get("JAX_LOCAL_DEVICE_IDS")
    if (env.get("JAX_PLATFORMS") or jax.config.jax_platforms or "cpu").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                               int(env["JAX_PROCESS_ID"]),
                               local_device_ids=[int(i) for i in local.split(",")] if local else None)
    return True


def parse_mesh(text: str | None, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """A mesh from "data=4,model=2" (axes `data` and `model`, either may be left out: size 1); None
    for None or "". Uses the first data·model of `devices` (default all, every process's) through
    `jax.make_mesh`, axes of type Auto (XLA propagates shardings between the constrained points).
    Raises ValueError for an unknown axis, a bad size or more devices than there are."""
    if not text:
        return None
    sizes = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not match or match.group(1) not in AXES or match.group(1) in sizes or int(match.group(2)) < 1:
            raise ValueError(f"bad mesh {text!r}: expected e.g. 'data=4,model=2' (axes {AXES}, sizes ≥ 1, once each)")
        sizes[match.group(1)] = int(match.group(2))
    shape = tuple(sizes.get(a, 1) for a in AXES)
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) > len(devices):
        raise ValueError(f"mesh {text!r} needs {math.prod(shape)} devices, there are {len(devices)}")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices[: math.prod(shape)])


def axis_size(mesh: Mesh | None, axis: str) -> int:
    """Size of `axis` in `mesh` (1 when the mesh or the axis is absent)."""
    return 1 if mesh is None else dict(mesh.shape).get(axis, 1)


def _split(mesh: Mesh | None, axis: str, dim: int) -> str | None:
    """`axis` if it has size > 1 and divides `dim`, else None (replicated)."""
    n = axis_size(mesh, axis)
    return axis if n > 1 and dim % n == 0 else None


_warned: set[tuple[int, int]] = set()


def head_axis(config: ModelConfig, mesh: Mesh | None) -> str | None:
    """`model` when it splits the kv heads (and with them their query heads), else None (logged once
    per (kv heads, model size): attention and the cache are then replicated over `model`)."""
    axis, size = _split(mesh, MODEL, config.num_kv_heads), axis_size(mesh, MODEL)
    if axis is None and size > 1 and (config.num_kv_heads, size) not in _warned:
        _warned.add((config.num_kv_heads, size))
        log.warning("%d kv heads are not divisible by model=%d: attention and the KV cache are replicated "
                    "over the model axis", config.num_kv_heads, size)
    return axis


def describe(config: ModelConfig, mesh: Mesh | None, batch: int | None = None) -> list[str]:
    """Human-readable lines: the mesh, and what is split or replicated over it, and why."""
    if mesh is None:
        return ["no mesh: one device"]
    data, model = axis_size(mesh, DATA), axis_size(mesh, MODEL)
    lines = [f"mesh data={data} model={model} over {mesh.devices.size} devices, {jax.process_count()} process(es)"]
    if model > 1:
        if head_axis(config, mesh):
            lines.append(f"{config.num_kv_heads} kv heads ({config.num_heads} query heads) split over model={model}")
        else:
            lines.append(f"{config.num_kv_heads} kv heads not divisible by model={model}: attention and the "
                         f"KV cache are replicated over model (the MLP is still split)")
        if config.intermediate_size % model:
            lines.append(f"MLP width {config.intermediate_size} not divisible by model={model}: replicated")
    if batch is not None and data > 1 and batch % data:
        lines.append(f"batch {batch} not divisible by data={data}: rows replicated over data")
    return lines


# ---- specs -------------------------------------------------------------------------------------

#: Parameter rules: (path suffix, logical axis per array dim). "heads": query- or kv-head-major dim
#: (split when `model` divides the kv heads); "mlp", "vocab": split when `model` divides the dim.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("self_attn.q_proj.kernel", (None, None, "heads")),
    ("self_attn.k_proj.kernel", (None, None, "heads")),
    ("self_attn.v_proj.kernel", (None, None, "heads")),
    ("self_attn.o_proj.kernel", (None, "heads", None)),
    ("mlp.gate_proj.kernel", (None, None, "mlp")),
    ("mlp.up_proj.kernel", (None, None, "mlp")),
    ("mlp.down_proj.kernel", (None, "mlp", None)),
    ("attn.qk_bias", (None, None, None, "heads", None)),
    ("attn.proj.kernel", (None, "heads", None)),
    ("mlp.proj.kernel", (None, "mlp", None)),
    ("lm_head.kernel", (None, "vocab")),
)


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path(path) -> str:
    return ".".join(_key_name(k) for k in path if _key_name(k) != "value")


def param_specs(state: Any, config: ModelConfig, mesh: Mesh | None) -> Specs:
    """PartitionSpecs of a model state (`nnx.state(model)`, or its `nnx.Param` part), same structure.

    Arrays or `jax.ShapeDtypeStruct`s alike; the rules are in the module docstring (`PARAM_RULES`)."""
    heads = head_axis(config, mesh)

    def spec(path, x):
        name = _path(path)
        for suffix, logical in PARAM_RULES:
            if name.endswith(suffix) and len(logical) == x.ndim:
                return P(*(heads if a == "heads" else _split(mesh, MODEL, d) if a else None
                           for a, d in zip(logical, x.shape)))
        return P()

    return jax.tree_util.tree_map_with_path(spec, state)


def cache_specs(cache: KVCache, mesh: Mesh | None) -> Specs:
    """PartitionSpecs of a cache (concrete or from `jax.eval_shape`), a `KVCache` of specs: state
    leaves [G, N, B, K, S, ...] → P(None, None, data, model); the per-row fields [B] (`lengths`,
    `overflow`, ..., a paged cache's block table) → P(data). A paged cache's pool [G, N, NP, K, P, ...]
    keeps its pages whole on every device (any row may read any page): P(None, None, None, model)."""
    b, k = cache.lengths.shape[0], _kv_heads(cache)
    rows, heads = _split(mesh, DATA, b), _split(mesh, MODEL, k)
    pages = None if cache.block_table is not None else rows

    def slot(x):
        return P(None, None, pages, heads)
    per_row = jax.tree_util.tree_map(lambda x: P(rows) if x.ndim and x.shape[0] == b else P(), cache)
    return per_row.replace(looped=jax.tree_util.tree_map(slot, cache.looped),
                           plain=None if cache.plain is None else jax.tree_util.tree_map(slot, cache.plain))


def _kv_heads(cache: KVCache) -> int:
    return jax.tree_util.tree_leaves(cache.looped)[0].shape[3]


def calib_specs(calib: CacheCalib | None, mesh: Mesh | None, fmt: CacheFormat,
                plain_fmt: CacheFormat | None = None) -> Specs:
    """PartitionSpecs of a `CacheCalib` (None → None) for the formats of its looped (`fmt`) and plain
    (`plain_fmt`, default `fmt`) layers: the kv-head axis of each leaf a format names in its
    `calib_head_axes` (rotations, key means, RVQ scales) over `model` when it divides the kv heads
    (as the cache's does); the rest replicated."""
    if calib is None:
        return None

    def part(entries, f: CacheFormat):
        def spec(path, x):
            axis = f.calib_head_axes.get(_key_name(path[-1])) if path else None
            heads = None if axis is None or x.ndim <= axis else _split(mesh, MODEL, x.shape[axis])
            return P() if heads is None else P(*(None,) * axis, heads)

        return None if entries is None else jax.tree_util.tree_map_with_path(spec, entries)

    return CacheCalib(part(calib.looped, fmt), part(calib.plain, plain_fmt or fmt))


def batch_spec(mesh: Mesh | None, shape: Sequence[int]) -> P:
    """P(data) for an array of `shape` whose leading axis is the batch, P() if `data` does not divide it."""
    return P(_split(mesh, DATA, shape[0])) if len(shape) else P()


# ---- placing and constraining ------------------------------------------------------------------


def named(mesh: Mesh, specs: Specs) -> Any:
    """The `NamedSharding`s of a spec tree (e.g. for `jax.jit(in_shardings=..., out_shardings=...)`)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """`NamedSharding` of a batch-leading array of `shape` (see `batch_spec`)."""
    return NamedSharding(mesh, batch_spec(mesh, shape))


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated `NamedSharding` of `mesh`."""
    return NamedSharding(mesh, P())


def put(tree: Any, shardings: Any) -> Any:
    """Global arrays from a tree of host values (numpy or jax arrays) every process holds in full,
    placed by `shardings` (a matching tree, or one sharding for every leaf). Typed PRNG keys are kept
    typed. Works in one process (a `device_put`) and in many (each fills its own shards)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

    def one(x, sharding):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(one, tree, shardings)


def process_rows(sharding: NamedSharding, shape: Sequence[int]) -> np.ndarray:
    """Global row indices (leading axis) that this process's devices hold under `sharding`, in the
    order `put_process_local` expects its local rows: each process loads only these."""
    spans = {(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
             for idx in sharding.addressable_devices_indices_map(tuple(shape)).values()}
    return np.concatenate([np.arange(a, b) for a, b in sorted(spans)]) if spans else np.arange(0)


def put_process_local(local: np.ndarray, sharding: NamedSharding, shape: Sequence[int]) -> jax.Array:
    """A global array of `shape` from this process's rows `local` (those of `process_rows`)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), tuple(shape))


def constrain(tree: Any, specs: Specs, mesh: Mesh | None) -> Any:
    """`with_sharding_constraint` of `tree` to `specs` on `mesh` (inside jit); identity without a mesh."""
    if mesh is None or tree is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, named(mesh, specs))


def to_host(tree: Any) -> Any:
    """numpy copies of every leaf on every process (gathered across processes when needed)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(one, tree)


# ---- models, caches, calibration ---------------------------------------------------------------


def shard_state(state: Any, config: ModelConfig, mesh: Mesh | None) -> Any:
    """A model state (or its params) placed by `param_specs`; unchanged without a mesh."""
    if mesh is None:
        return state
    return put(state, named(mesh, param_specs(state, config, mesh)))


def shard_model(model, mesh: Mesh | None):
    """`model` (an Ouro or Huginn nnx module) with its arrays placed by `param_specs` (a new module)."""
    if mesh is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, shard_state(state, model.config, mesh))


def init_sharded_cache(config: ModelConfig, batch: int, max_len: int, fmt=None, mesh: Mesh | None = None, *,
                       num_loops: int | None = None, plain_fmt=None, track_steps: bool = False) -> KVCache:
    """`rq_jax.cache.init_cache`, built directly in its sharded layout (`cache_specs`): no device
    ever holds the whole cache."""
    def make():
        return init_cache(config, batch, max_len, fmt, num_loops=num_loops, plain_fmt=plain_fmt,
                          track_steps=track_steps)

    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=named(mesh, cache_specs(jax.eval_shape(make), mesh)))()


def shard_calib(calib: CacheCalib | None, mesh: Mesh | None, fmt: CacheFormat,
                plain_fmt: CacheFormat | None = None) -> CacheCalib | None:
    """`calib` placed by `calib_specs`."""
    if mesh is None or calib is None:
        return calib
    return put(calib, named(mesh, calib_specs(calib, mesh, fmt, plain_fmt)))


def constrain_cache(cache: KVCache, mesh: Mesh | None) -> KVCache:
    """`cache` constrained to `cache_specs` inside a jitted function (identity without a mesh)."""
    return cache if mesh is None or cache is None else constrain(cache, cache_specs(cache, mesh), mesh)
