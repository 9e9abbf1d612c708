"""LoRA adapters on the attention projections, as an overlay on the model's parameters.

For every linear projection inside an attention module (Ouro: q/k/v/o_proj; Huginn: Wqkv and proj
of the prelude, core and coda blocks) the adapter holds A [..., in, r] and B [..., r, out] (a leading
[N] layer axis for stacked layers), and the model computes with

    W' = W + (alpha / r) · A B          A ~ N(0, 1/in), B = 0: W' = W at initialisation

`apply(params, adapters, scale)` returns the overlaid parameter state; the base state is never
modified, so frozen weights stay bit-identical and only the adapters train. `merge` writes the same
sum into a model for export: the merged model computes exactly what the overlay model computes.

Adapters are a nested dict mirroring the projection's path, e.g.
`{"layers": {"self_attn": {"q_proj": {"a": ..., "b": ...}}}}` (an orbax- and optax-friendly pytree).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rq_jax.nn.huginn import HuginnAttention
from rq_jax.nn.ouro import OuroAttention

ATTENTION = (OuroAttention, HuginnAttention)
Adapters = dict[str, Any]
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank r and alpha of the adapters; the update is scaled by alpha / r."""

    rank: int = 8
    alpha: float = 16.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def attention_projections(model: nnx.Module) -> list[tuple[str, ...]]:
    """Paths of the linear projections inside the model's attention modules, sorted."""
    attn = {tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, ATTENTION)}
    return sorted(tuple(path) for path, node in nnx.iter_graph(model)
                  if isinstance(node, nnx.Linear) and tuple(path[:-1]) in attn)


def _names(keypath) -> tuple[str, ...]:
    """The attribute names of a pytree key path into an nnx.State (dict keys; the Variable's `value` dropped)."""
    return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def _lookup(adapters: Adapters, path: tuple[str, ...]) -> dict | None:
    node = adapters
    for name in path:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node


def init(model: nnx.Module, config: LoRAConfig, key: jax.Array) -> Adapters:
    """Adapters for every attention projection of `model`: A ~ N(0, 1/in), B = 0 (float32)."""
    kernels = {_names(kp)[:-1]: leaf for kp, leaf in
               jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0] if _names(kp)[-1] == "kernel"}
    adapters: Adapters = {}
    for i, path in enumerate(attention_projections(model)):
        w = kernels[path]
        *lead, din, dout = w.shape
        a = jax.random.normal(jax.random.fold_in(key, i), (*lead, din, config.rank), jnp.float32) * din**-0.5
        node = adapters
        for name in path:
            node = node.setdefault(name, {})
        node.update(a=a, b=jnp.zeros((*lead, config.rank, dout), jnp.float32))
    return adapters


def apply(params: nnx.State, adapters: Adapters, scale: float) -> nnx.State:
    """`params` with W + scale · A B in place of each adapted kernel W (same dtype); the rest as they are."""
    def one(keypath, w):
        names = _names(keypath)
        ad = _lookup(adapters, names[:-1]) if names and names[-1] == "kernel" else None
        if ad is None:
            return w
        return w + (scale * jnp.matmul(ad["a"], ad["b"], precision=_HI)).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def merge(model: nnx.Module, adapters: Adapters, scale: float) -> nnx.Module:
    """A new model whose attention projections hold the merged weights W + scale · A B."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, apply(params, adapters, scale), rest)
