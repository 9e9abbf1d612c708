"""Pallas GPU decode-attention kernels (Triton backend) over rq_jax's cache layouts.

Each kernel module holds the kernel, its `pallas_call` wrapper, the jitted public function and a
plain-jnp `*_reference` with the same signature. This package imports nothing from rq_jax: callers
pass arrays in the documented layouts.

    residual_decode_attention   packed ResidualQuant chains (also `uniform`/`rotated`: one-link chains)
    dense_decode_attention      bf16/f32 K/V, the baseline
"""

from pallas_kernels.decode_common import NEG
from pallas_kernels.dense_attention import dense_decode_attention, dense_decode_attention_reference
from pallas_kernels.residual_attention import (
    QuantStream,
    residual_decode_attention,
    residual_decode_attention_reference,
)

__all__ = [
    "NEG",
    "QuantStream",
    "dense_decode_attention",
    "dense_decode_attention_reference",
    "residual_decode_attention",
    "residual_decode_attention_reference",
]
