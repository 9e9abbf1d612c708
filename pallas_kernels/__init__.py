"""Pallas decode-attention kernels over rq_jax's cache layouts: Triton (GPU) and Mosaic (TPU).

Each kernel module holds the kernel, its `pallas_call` wrapper, the jitted public function and a
plain-jnp `*_reference` with the same signature. This package imports nothing from rq_jax: callers
pass arrays in the documented layouts.

    residual_decode_attention       packed ResidualQuant chains (also `uniform`/`rotated`: one-link chains)
    dense_decode_attention          bf16/f32 K/V, the baseline
    tpu_residual_attention,         the same two on a TPU (Mosaic), pages read through a block table
    tpu_dense_attention
    deviceless, tpu_deviceless      compiles for GPUs / TPUs on a host without one

Importing the package quiets libtpu on a host without a TPU (`tpu_deviceless.quiet_libtpu`).
"""

from pallas_kernels.decode_common import NEG
from pallas_kernels.dense_attention import dense_decode_attention, dense_decode_attention_reference
from pallas_kernels.residual_attention import (
    QuantStream,
    residual_decode_attention,
    residual_decode_attention_reference,
)
from pallas_kernels.tpu_deviceless import quiet_libtpu

quiet_libtpu()

__all__ = [
    "NEG",
    "QuantStream",
    "dense_decode_attention",
    "dense_decode_attention_reference",
    "residual_decode_attention",
    "residual_decode_attention_reference",
]
