"""Quantization toolbox: affine INTn, packing, rotations, LS residuals, RVQ, STE, bit accounting.

Every function is pure and jit/vmap-able (configs are hashable static arguments) and knows nothing
about models. Submodules: ``affine``, ``packing``, ``rotation``, ``residual``, ``rvq``, ``ste``,
``bits``.
"""

from rq_jax.quant import affine, bits, packing, residual, rotation, rvq, ste
from rq_jax.quant.affine import QuantConfig, Quantized, dequantize, fake_quant, quantize
from rq_jax.quant.bits import bits_per_element, stored_nbytes
from rq_jax.quant.packing import pack, packed_dim, unpack
from rq_jax.quant.residual import (
    EncodedGroup,
    ResidualConfig,
    decode_group,
    decode_loop,
    encode_decode_group,
    encode_group,
    ls_alpha,
)
from rq_jax.quant.rotation import (
    hadamard,
    learned_rotation,
    make_rotation,
    random_orthogonal,
    rotate,
    unrotate,
)
from rq_jax.quant.rvq import RVQCodebooks, fit_rvq, kmeans
from rq_jax.quant.ste import ste_fake_quant, ste_residual_group, ste_rvq, straight_through

__all__ = [
    "EncodedGroup",
    "QuantConfig",
    "Quantized",
    "RVQCodebooks",
    "ResidualConfig",
    "affine",
    "bits",
    "bits_per_element",
    "decode_group",
    "decode_loop",
    "dequantize",
    "encode_decode_group",
    "encode_group",
    "fake_quant",
    "fit_rvq",
    "hadamard",
    "kmeans",
    "learned_rotation",
    "ls_alpha",
    "make_rotation",
    "pack",
    "packed_dim",
    "packing",
    "quantize",
    "random_orthogonal",
    "residual",
    "rotate",
    "rotation",
    "rvq",
    "ste",
    "ste_fake_quant",
    "ste_residual_group",
    "ste_rvq",
    "stored_nbytes",
    "straight_through",
    "unpack",
    "unrotate",
]
