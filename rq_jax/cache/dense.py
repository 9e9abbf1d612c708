"""The `dense` format: K/V stored as they are, in bfloat16 or float32."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

from rq_jax.cache import base
from rq_jax.quant import ste


class DenseSlot(NamedTuple):
    """Stored keys and values, [G, N, B, K, S, D] each."""

    k: Float[Array, "g n b k s d"]
    v: Float[Array, "g n b k s d"]


@base.register("dense")
@dataclasses.dataclass(frozen=True)
class Dense(base.CacheFormat):
    """Full-precision storage; `dtype` is "bfloat16" or "float32". Every loop is its own group."""

    dtype: str = "bfloat16"
    name: str = dataclasses.field(default="dense", init=False)
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dense cache dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[DenseSlot]:
        """Zeroed [G, N, B, K, S, D] keys and values."""
        shape = (seg.groups, num_layers, batch, num_kv_heads, max_len, head_dim)
        return (DenseSlot(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)),)

    def write(self, state, k, v, lengths, num_new, calib) -> base.Written:
        """Store new K/V [G, 1, N, B, K, T, D] at positions lengths[b] + t, t < num_new[b]."""
        new = base.scatter_tokens(state[0], DenseSlot(k[:, 0], v[:, 0]), lengths, num_new)
        return base.Written((new,), base.nothing_lost(lengths))

    def reconstruct(self, state, index, loop, lengths, calib):
        """The stored K, V of slot `index` as float32 [B, K, S, D] (positions s ≥ lengths[b] are 0 already)."""
        slot = base.at(state[loop], index)
        return slot.k.astype(jnp.float32), slot.v.astype(jnp.float32)

    def fake_quant(self, k, v, calib) -> tuple[Array, Array]:
        """K/V rounded to the storage dtype (float32 values), gradients passed straight through."""
        def cast(x):
            x = x.astype(jnp.float32)
            return ste.straight_through(x, x.astype(self.dtype).astype(jnp.float32), jnp.ones((), jnp.float32))

        return cast(k), cast(v)

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """16 or 32."""
        return Fraction(jnp.dtype(self.dtype).itemsize * 8)

    def describe(self) -> str:
        return {"bfloat16": "bf16", "float32": "f32"}[self.dtype]
