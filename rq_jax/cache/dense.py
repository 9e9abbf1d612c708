"""The `dense` format: K/V stored as they are, in bfloat16 or float32."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rq_jax.cache import base


class DenseState(NamedTuple):
    """Stored keys and values, [L, N, B, K, S, D] each."""

    k: Float[Array, "l n b k s d"]
    v: Float[Array, "l n b k s d"]


@base.register("dense")
@dataclasses.dataclass(frozen=True)
class Dense:
    """Full-precision storage; `dtype` is "bfloat16" or "float32"."""

    dtype: str = "bfloat16"
    name: str = dataclasses.field(default="dense", init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dense cache dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    def init(self, num_loops, num_layers, batch, max_len, num_kv_heads, head_dim) -> DenseState:
        """Zeroed [L, N, B, K, S, D] keys and values."""
        shape = (num_loops, num_layers, batch, num_kv_heads, max_len, head_dim)
        return DenseState(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def default_calib(self, num_loops, num_layers, num_kv_heads, head_dim) -> None:
        """Dense storage needs no calibration."""
        return None

    def calibrate(self, k, v, lengths) -> None:
        """Dense storage needs no calibration."""
        return None

    def attend(self, state: DenseState, q, loop: int, layer: int, lengths: Int[Array, "b"], calib) -> base.Partial:
        """Partial attention to the stored tokens of slot (loop, layer)."""
        return base.reference_attend(self, state, q, loop, layer, lengths, calib)

    def reconstruct(self, state: DenseState, loop: int, layer: int, calib):
        """The stored K, V of slot (loop, layer) as float32 [B, K, S, D]."""
        return state.k[loop, layer].astype(jnp.float32), state.v[loop, layer].astype(jnp.float32)

    def write(self, state: DenseState, k, v, lengths, num_new, calib) -> DenseState:
        """Store new K/V [L, N, B, K, T, D] at positions lengths[b] + t, t < num_new[b]."""
        return base.scatter_tokens(state, DenseState(k, v), lengths, num_new, token_axis=4)

    def nbytes(self, state: DenseState) -> int:
        """Bytes of the stored arrays."""
        return base.tree_nbytes(state)

    def bits_per_element(self, num_loops: int, head_dim: int) -> Fraction:
        """16 or 32."""
        return Fraction(jnp.dtype(self.dtype).itemsize * 8)
