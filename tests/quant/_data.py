"""Shared test data helpers for tests/quant."""

import numpy as np
from hypothesis import strategies as st

# (group_size, head_dim) pairs: powers of two and the odd head dims 96 (Huginn) and 24.
SHAPES = [(16, 32), (16, 96), (32, 96), (32, 128), (64, 128), (128, 128), (8, 24), (24, 24)]
BITS = [1, 2, 3, 4, 8]
META = ["float8_e4m3fn", "bfloat16", "float16", "float32"]
SCALES = [1e-6, 1e-3, 1.0, 30.0, 1e3]
KINDS = ["normal", "uniform", "heavy", "outlier", "int"]


def make_data(seed: int, shape, kind: str = "normal", scale: float = 1.0) -> np.ndarray:
    """Deterministic float32 test data of a few distributions."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, shape) + rng.uniform(-2, 2)
    elif kind == "heavy":
        x = rng.standard_t(3, shape)
    elif kind == "outlier":
        x = rng.standard_normal(shape)
        x.flat[rng.integers(x.size)] = 40.0
    else:
        x = rng.integers(-3, 4, shape).astype(np.float64)
    return (x * scale).astype(np.float32)


data_args = dict(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(KINDS),
    scale=st.sampled_from(SCALES),
)
