"""Primitives shared by Ouro and Huginn: RMSNorm, both RoPE variants, projections and MLPs.

Parameters live in `param_dtype`; each module computes in `dtype` (float32 or bfloat16, or float64
with `jax_enable_x64`), independent of the checkpoint's dtype. What the references compute in float32
(norms, RoPE, softmax, logits) runs in `wide(dtype)`: float32, or float64 in a float64 run, so that a
float64 run is float64 throughout and can serve as the exact reference of a float32 one.
Linear kernels are [in, out] (the HF converter transposes). Matrix products take the weights as stored
(`matmul`): the activations are cast to the weight's dtype and the product accumulates in
`wide(weight dtype)`, so a step never makes a converted copy of a weight matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int


def wide(dtype) -> jnp.dtype:
    """The dtype of the steps the references run in float32: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 (float64 for float64 x); output `weight * normed.astype(x.dtype)` as
    both references do."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... e"]) -> Float[Array, "... e"]:
        xw = x.astype(wide(x.dtype))
        normed = xw * jax.lax.rsqrt(jnp.mean(xw * xw, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def matmul(x: Float[Array, "... i"], w: Float[Array, "i o"], dtype) -> Float[Array, "... o"]:
    """x @ w with w as stored: x cast to w's dtype, `wide(w.dtype)` accumulation, the result in `dtype`.

    Converting w instead (what flax's dtype promotion does) copies the whole matrix on every call: a
    bf16 output head of 49152 × 2048 becomes 0.37 GiB of float32 temporaries in each decode step.
    """
    lead = x.shape[:-1]
    x = x.astype(w.dtype).reshape(-1, x.shape[-1])
    rows = x.shape[0]
    if rows == 1 and w.dtype.itemsize < 4:  # XLA:CPU rewrites a one-row product as a multiply-and-sum,
        x = jnp.pad(x, ((0, 1), (0, 0)))  # which it widens to float32 (a copy of w): two rows stay a dot
    y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=wide(w.dtype))[:rows]
    return y.reshape(*lead, w.shape[-1]).astype(dtype)


class Linear(nnx.Linear):
    """`nnx.Linear` computing with its kernel as stored (`matmul`), the bias added in `wide` precision;
    output in `dtype` (the input's dtype when None)."""

    def __call__(self, x: Float[Array, "... i"]) -> Float[Array, "... o"]:
        dtype = self.dtype or x.dtype
        acc = wide(self.kernel.dtype)
        y = matmul(x, self.kernel[...], acc)
        if self.bias is not None:
            y = y + self.bias[...].astype(acc)
        return y.astype(dtype)


def linear(din: int, dout: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float, bias: bool = False) -> Linear:
    """A bias-free (unless `bias`) `Linear` initialised N(0, std²)."""
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=nnx.initializers.normal(std), rngs=rngs)


def rope_angles(positions: Int[Array, "b t"], head_dim: int, theta: float,
                dtype=jnp.float32) -> Float[Array, "b t d2"]:
    """RoPE angles pos·θ^(−2i/D) for i < D/2 in `wide(dtype)` (both families use this frequency table)."""
    dtype = wide(dtype)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    return positions.astype(dtype)[..., None] * inv_freq


class Rope(NamedTuple):
    """RoPE's cos and sin of the angles pos·θ^(−2i/D) (`rope_angles`), [b, t, D/2] each in `wide(dtype)`:
    computed once per call (`rope_table`) and read by every layer of every loop (recomputed in each layer,
    the sines and cosines took ~9% of Ouro-small's prompt calls on a CPU)."""

    cos: Float[Array, "b t d2"]
    sin: Float[Array, "b t d2"]


def rope_table(positions: Int[Array, "b t"], head_dim: int, theta: float, dtype=jnp.float32) -> Rope:
    """The `Rope` of `positions` [b, t]: cos and sin [b, t, D/2] of `rope_angles`."""
    angles = rope_angles(positions, head_dim, theta, dtype)
    return Rope(jnp.cos(angles), jnp.sin(angles))


def rope_half(x: Float[Array, "b t h d"], rope: Rope) -> Float[Array, "b t h d"]:
    """Llama-style RoPE on halves (`rotate_half`), as Ouro uses; cos/sin cast to x's dtype."""
    cos, sin = (jnp.concatenate([c, c], axis=-1)[:, :, None, :].astype(x.dtype) for c in rope)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rope_interleaved(x: Float[Array, "b t h d"], rope: Rope) -> Float[Array, "b t h d"]:
    """RoPE on interleaved pairs (2i, 2i+1), computed in float32 (float64 for float64 x), as Huginn does."""
    cos, sin = rope.cos[:, :, None, :], rope.sin[:, :, None, :]
    pairs = x.astype(wide(x.dtype)).reshape(*x.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
