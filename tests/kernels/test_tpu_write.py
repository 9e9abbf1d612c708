"""The TPU (Mosaic) decode-token store: TPU interpret mode (race detector on) against its jnp scatter, the
leaves it declines, and real compiles for v5e and v6e through libtpu (skipped where `jax[tpu]` is missing):
in place (no temporaries) where XLA:TPU's own scatter copies the leaf, and inlined in the cache's write.

The store moves bits, so the comparison is exact: every dtype a cache leaf holds (uint8 codes, FP8 and bf16
metadata, bf16/f32 α), with old entries and new tokens random, NaN bits included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_deviceless as td
from pallas_kernels import tpu_write as tw
from rq_jax.cache import base

from .test_tpu_attention import interpret, races_found

needs_libtpu = pytest.mark.skipif(not td.libtpu_available(),
                                  reason="libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")

# (leaf shape [G, N, B, K, S, (C)], dtype): codes of a 2-bit and a 4-bit link at head dim 128, FP8 and bf16
# metadata of 4 groups, α; S of one lane block, of several, and under one.
LEAVES = [
    ((1, 2, 5, 2, 384, 32), "uint8"),
    ((2, 1, 5, 2, 256, 64), "uint8"),
    ((1, 2, 5, 2, 256, 4), "float8_e4m3fn"),
    ((1, 1, 5, 3, 128, 8), "bfloat16"),
    ((1, 3, 5, 2, 256), "bfloat16"),
    ((1, 1, 5, 2, 64), "float32"),
]


def _bits(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, tw._UINT[x.dtype.itemsize]))


def _random(rng, shape, dtype) -> jax.Array:
    """Random bits of `dtype` (NaNs and infinities of a float dtype included)."""
    width = jnp.dtype(dtype).itemsize
    raw = rng.integers(0, 2 ** (8 * width), shape, dtype=np.uint64).astype(np.dtype(f"uint{8 * width}"))
    return jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.dtype(dtype))


@pytest.mark.parametrize("shape, dtype", LEAVES, ids=[f"{d}{list(s)}" for s, d in LEAVES])
def test_interpret_equals_scatter(shape, dtype):
    """Rows at position 0, 1, a lane block's last and next position, S − 1, S (dropped) and one with no new
    token: the stored leaf's bits equal the reference's, nothing else changed, and no race."""
    rng = np.random.default_rng(sum(shape))
    s, token_axis = shape[4], 4
    old = _random(rng, shape, dtype)
    new = _random(rng, (*shape[:4], 1, *shape[5:]), dtype)
    lengths = jnp.asarray([0, 1, min(127, s - 1), min(128, s - 1), s - 1][:shape[2] - 1] + [s], jnp.int32)
    num_new = jnp.asarray([1, 1, 0, 1, 1][:shape[2] - 1] + [1], jnp.int32)
    want = tw.tpu_write_token_reference(old, new, lengths, num_new, token_axis=token_axis)
    got = tw.tpu_write_token(jnp.copy(old), new, lengths, num_new, token_axis=token_axis, interpret=interpret())
    assert not races_found()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    changed = (_bits(want) != _bits(old)).reshape(*shape[:4], s, -1).any(-1)  # [G, N, B, K, S]
    assert changed.any() and not changed[:, :, 2].any() and not changed[:, :, -1].any()


@pytest.mark.parametrize("page, dtype", [(128, "uint8"), (16, "float8_e4m3fn")])
def test_interpret_pool(page, dtype):
    """A pool [G, N, NP, K, P, C] through a block table: rows at a page's first and last position, at the last
    position of their capacity, past it (dropped), and a padding row (no token) whose table names the page a
    real row writes — the real row's token lands, and no race."""
    rng = np.random.default_rng(page)
    pool_pages, cols = 9, 3
    shape = (1, 2, pool_pages, 2, page, 8)
    old = _random(rng, shape, dtype)
    new = _random(rng, (1, 2, 5, 2, 1, 8), dtype)
    table = jnp.asarray([[4, 1, 7], [2, 0, -1], [6, 3, 5], [8, 2, 0], [5, 5, 5]], jnp.int32)
    lengths = jnp.asarray([page, page - 1, cols * page - 1, cols * page, 0], jnp.int32)
    num_new = jnp.asarray([1, 1, 1, 1, 0], jnp.int32)
    want = tw.tpu_write_token_reference(old, new, lengths, num_new, table, token_axis=4)
    got = tw.tpu_write_token(jnp.copy(old), new, lengths, num_new, table, token_axis=4, interpret=interpret())
    assert not races_found()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    changed = (_bits(want) != _bits(old)).reshape(1, 2, pool_pages, 2, page, -1).any((0, 1, 3, 5))  # [NP, P]
    assert changed[1, 0] and changed[2, page - 1] and changed[5, page - 1] and changed.sum() == 3


@pytest.mark.parametrize("shape, tokens, dtype, why", [
    ((1, 1, 2, 2, 256, 32), 4, "uint8", "4 tokens a call"),
    ((1, 1, 2, 2, 256, 128), 1, "bfloat16", "128 channels, a multiple of 128"),
    ((1, 1, 2, 2, 200, 32), 1, "uint8", "S = 200, not a multiple of 128"),
])
def test_declines_by_name(shape, tokens, dtype, why):
    """What the store does not cover is named, and the cache's TPU write (`base._write_tpu`) scatters it."""
    assert why in tw.covers(shape, tokens, 4, dtype)
    old = jnp.zeros(shape, dtype)
    new = jnp.ones((*shape[:4], tokens, *shape[5:]), dtype)
    with pytest.raises(ValueError, match=why):
        tw.tpu_write_token(old, new, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), token_axis=4)
    lengths, num_new = jnp.asarray([0, 3], jnp.int32), jnp.asarray([tokens, 1], jnp.int32)
    want = base._scatter(old, new, lengths, num_new)
    np.testing.assert_array_equal(base._write_tpu(old, new, lengths, num_new), want)


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_compiled_in_place_where_xla_copies(generation):
    """A 4-bit link's codes leaf (64 bytes a token at head dim 128; 4 layers, batch 8, 16 heads, 4k tokens:
    128 MiB, compiled, not allocated) and an FP8 metadata leaf, donated: XLA:TPU's scatter copies the codes
    leaf whole (temporaries ≥ the leaf; a leaf small enough for VMEM it writes in place), the store has none;
    the cache's write lowered for a TPU inlines the store, into a contiguous leaf and into the engine's pool."""
    codes = jax.ShapeDtypeStruct((1, 4, 8, 16, 4096, 64), jnp.uint8)
    meta = jax.ShapeDtypeStruct((1, 4, 8, 16, 4096, 4), jnp.float8_e4m3fn)
    rows = jax.ShapeDtypeStruct((8,), jnp.int32)

    def compiled(write, leaf):
        args = td.place((leaf, jax.ShapeDtypeStruct((*leaf.shape[:4], 1, *leaf.shape[5:]), leaf.dtype), rows, rows),
                        generation)
        return jax.jit(write, donate_argnums=0).lower(*args).compile()

    leaf_bytes = int(np.prod(codes.shape))
    scattered = compiled(base._scatter, codes)
    assert scattered.memory_analysis().temp_size_in_bytes >= leaf_bytes
    for leaf in (codes, meta):
        stored = compiled(lambda o, n, l, m: base.scatter_tokens(o, n, l, m), leaf)
        assert td.mosaic_calls(stored.as_text()), "the TPU write did not inline the Mosaic store"
        assert stored.memory_analysis().temp_size_in_bytes < 64 * 1024
    # The engine's pool: the codes as 256 pages of 128 tokens, each row's page looked up in its table.
    pool = jax.ShapeDtypeStruct((1, 4, 256, 16, 128, 64), jnp.uint8)
    args = td.place((pool, jax.ShapeDtypeStruct((1, 4, 8, 16, 1, 64), jnp.uint8), rows, rows,
                     jax.ShapeDtypeStruct((8, 32), jnp.int32)), generation)
    stored = jax.jit(base.scatter_tokens, donate_argnums=0).lower(*args).compile()
    assert td.mosaic_calls(stored.as_text()) and stored.memory_analysis().temp_size_in_bytes < 64 * 1024
