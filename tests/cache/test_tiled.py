"""Tiled attention and in-place writes: every format's tiled `attend` equals `reference_attend` on
ragged lengths (0, 1, a tile boundary ± 1, max_len), the tile loop follows the filled length, the
tiled self-attention of a long call equals one dense block (values and gradients), chunked writes
equal one write, and the CPU's row-by-row token write equals the scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import base, context, get_format
from rq_jax.cache.base import Segment

TILE = base.MIN_TILE  # every test here forces the smallest tile (TILE_ELEMENTS = 1)
MAX_LEN = 2 * TILE + 8  # three tiles, the last one moved back to end at max_len
LENGTHS = [0, 1, TILE - 1, TILE, TILE + 1, MAX_LEN]
B, K, D, L, N = len(LENGTHS), 2, 16, 4, 2

FORMATS = {
    "dense bf16": ("dense", {}),
    "dense f32": ("dense", dict(dtype="float32")),
    "uniform": ("uniform", dict(group_size=8)),
    "rotated": ("rotated", dict(group_size=8)),
    "residual": ("residual", dict(group_size=8)),
    "residual super-scale": ("residual", dict(group_size=8, super_scale=True)),
    "residual previous": ("residual", dict(group_size=8, bits=(4, 2, 2, 2), reference="previous")),
    "kivi": ("kivi", dict(key_group=4, value_group=8, residual_length=8)),
    "kivi R=12": ("kivi", dict(bits=4, key_group=4, value_group=16, residual_length=12, meta_dtype="bfloat16")),
    "residual_vq lut": ("residual_vq", dict(attend_path="lut", n_codes=4, iters=2, restarts=1)),
    "residual_vq decode": ("residual_vq", dict(attend_path="decode", n_codes=4, iters=2, restarts=1)),
    "share last": ("share", {}),
    "turboquant 3bit_nc": ("turboquant", dict(preset="3bit_nc")),
    "turboquant k8v4": ("turboquant", dict(preset="k8v4")),
    "share mean rotated INT4": ("share", dict(source="mean", bits=4, group_size=8, rotation="hadamard")),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(base, "TILE_ELEMENTS", 1)


def random_kv(rng, loops, tokens, scale=2.0):
    shared = rng.normal(size=(1, N, B, K, tokens, D)) * scale
    k = shared + 0.3 * rng.normal(size=(loops, N, B, K, tokens, D))
    return jnp.asarray(k, jnp.float32), jnp.asarray(rng.normal(size=k.shape), jnp.float32)


def filled(fmt, rng):
    """A segment of 4 loops (or one per group) filled by two ragged writes to LENGTHS, and its calib."""
    seg = Segment(0, L // fmt.group_len, fmt.group_len)
    k, v = random_kv(rng, L, MAX_LEN)
    split = base.split_loops
    calib = fmt.calibrate(seg, split(k, seg), split(v, seg), jnp.asarray(LENGTHS))
    state = fmt.init(seg, N, B, MAX_LEN, K, D)
    lengths = jnp.zeros((B,), jnp.int32)
    first = jnp.asarray([min(n, 5) for n in LENGTHS])
    for num_new, at in ((first, 0), (jnp.asarray(LENGTHS) - first, 5)):
        part = jax.tree_util.tree_map(lambda x: split(x[..., at:, :], seg), (k, v))
        state = fmt.write(state, *part, lengths, num_new, calib).state
        lengths = lengths + num_new
    return seg, state, lengths, calib


@pytest.mark.parametrize("label", sorted(FORMATS))
def test_tiled_attend_equals_reference(label, small_tiles):
    """Float32 sums of the same products in another order: 2e-5 bounds the difference at these sizes."""
    t = 2
    name, policy = FORMATS[label]
    fmt = get_format(name, **policy)
    rng = np.random.default_rng(0)
    seg, state, lengths, calib = filled(fmt, rng)
    assert base.context_tile(B, t, 4, K, D, MAX_LEN) == TILE
    q = jnp.asarray(rng.normal(size=(B, t, 4, D)), jnp.float32)  # GQA: 4 query heads on 2 kv heads
    visible = jnp.asarray(rng.random((B, MAX_LEN)) < 0.7)
    attend = jax.jit(fmt.attend, static_argnums=2)
    for index, loop in (((0, 1), 0), ((seg.groups - 1, 0), seg.size - 1)):
        for vis in (None, visible):
            got = attend(state, index, loop, q, lengths, calib, vis)
            want = base.reference_attend(fmt, state, index, loop, q, lengths, calib, vis)
            np.testing.assert_allclose(got.m, want.m, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(got.l, want.l, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(base.finalize(got), base.finalize(want), atol=2e-5)
            assert np.all(np.asarray(got.l)[0] == 0)  # the empty row saw nothing


@pytest.mark.parametrize("filled_to,starts", [(0, []), (1, [0]), (TILE, [0]), (TILE + 1, [0, TILE]),
                                              (MAX_LEN, [0, TILE, MAX_LEN - TILE])])
def test_tile_loop_follows_the_filled_length(filled_to, starts):
    seen = []

    def part(stored, start, valid):
        jax.debug.callback(lambda s, n: seen.append((int(s), int(n))), start, jnp.sum(valid))
        return base.empty_partial(2, 1, 1, 1)

    lengths = jnp.asarray([filled_to, min(filled_to, 3)])
    jax.block_until_ready(jax.jit(lambda n: base.tiled_partial(part, (), (2, 1, 1, 1), n, MAX_LEN, TILE))(lengths))
    jax.effects_barrier()
    assert [s for s, _ in seen] == starts
    # Each position is counted once: the moved-back last tile hides what the tile before covered.
    assert sum(n for _, n in seen) == filled_to + min(filled_to, 3)


def causal_inputs(rng, t, heads=4, kv=2, d=8):
    q = jnp.asarray(rng.normal(size=(2, t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, kv, t, d)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("t", [16, 21])
def test_tiled_self_attention_equals_one_block(t, monkeypatch):
    """Query tiles × key tiles (causal tiles skipped) against one [T, T] block, with padding, hidden
    tokens and a past partial; gradients too (the tiled path is differentiable)."""
    rng = np.random.default_rng(1)
    q, k, v = causal_inputs(rng, t)
    mask = context.SelfMask(jnp.asarray([t, 7]), jnp.asarray(rng.random((2, t)) < 0.3))
    past = base.dense_partial(q, k * 2, v, jnp.ones((2, t, t), bool))

    def loss(q, k, v, tile):
        monkeypatch.setattr(context, "SELF_TILE", tile)
        out = context.attend_with_past(q, k, v, mask, past)
        return jnp.sum(out * jnp.cos(out)), out

    (want, dense), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, t)
    (got, tiled), tiled_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, 5)
    np.testing.assert_allclose(tiled, dense, atol=1e-5)
    for a, b in zip(tiled_grads, grads):
        np.testing.assert_allclose(a, b, atol=1e-4)
    explicit = context.attend_with_past(q, k, v, mask.block(0, t, 0, t), past)
    np.testing.assert_allclose(dense, explicit, atol=1e-6)


@pytest.mark.parametrize("label", ["dense bf16", "residual", "kivi", "kivi R=12", "residual_vq decode"])
def test_chunked_write_equals_one_write(label):
    """A call of 19 tokens written 4 at a time (4 full chunks and a rest of 3) gives the same state,
    also for rows that end early, hold nothing new, or run past the end of the cache."""
    name, policy = FORMATS[label]
    fmt = get_format(name, **policy)
    rng = np.random.default_rng(2)
    seg, state, lengths, calib = filled(fmt, rng)
    lengths = jnp.minimum(lengths, MAX_LEN - 9)  # room for 9 more: the 19-token rows overflow
    k, v = (base.split_loops(x[..., :19, :], seg) for x in random_kv(rng, L, 19))
    num_new = jnp.asarray([19, 0, 1, 4, 7, 19])
    one = fmt.write(state, k, v, lengths, num_new, calib)
    kv = context.in_flight_positions((k, v), seg.size)
    chunked = jax.jit(lambda *a: context.write_in_chunks(fmt, *a, chunk=4))(state, kv, lengths, num_new, calib)
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(chunked)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "uint8", "float32"])
@pytest.mark.parametrize("t", [1, 5, 12])
def test_row_writes_and_the_scatter_write_by_hand(dtype, t):
    """The CPU's per-row block writes and the other platforms' scatter both store what a loop over rows and
    tokens stores: token t of row b at lengths[b] + t when t < num_new[b] and inside S; padding tokens and
    tokens past S (a row near the end, where the block is moved back) dropped, every other value kept."""
    rng = np.random.default_rng(3)
    s = 10
    old = jnp.asarray(rng.normal(size=(2, 3, 4, 2, s, 3)) * 4).astype(dtype)
    new = jnp.asarray(rng.normal(size=(2, 3, 4, 2, t, 3)) * 4, jnp.float32)
    lengths, num_new = [0, 3, 8, 10], [t, 1, t, t]
    want = np.asarray(old, np.float32).copy()
    cast = np.asarray(new.astype(dtype), np.float32)
    for b, (start, n) in enumerate(zip(lengths, num_new)):
        for i in range(min(n, s - start)):
            want[:, :, b, :, start + i] = cast[:, :, b, :, i]
    for write in (base._write_rows, base._scatter):
        got = jax.jit(write)(old, new, jnp.asarray(lengths), jnp.asarray(num_new))
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=write.__name__)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "uint8", "bool"])
def test_updates_on_bits_equal_the_plain_updates(dtype):
    """base.on_bits runs a scatter (with dropped ids) and a dynamic-update-slice on a leaf's bits: the
    stored values are those of the same update on the leaf itself."""
    rng = np.random.default_rng(4)
    old = jnp.asarray(rng.normal(size=(2, 3, 5, 2, 4)) * 4).astype(dtype)
    new = jnp.asarray(rng.normal(size=(2, 3, 3, 2, 4)) * 4).astype(dtype)
    ids = jnp.asarray([4, 0, 5])  # 5: past the rows, dropped

    def scatter(big, small):
        return big.at[:, :, ids].set(small, mode="drop")

    def update(big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small, 1, 2)

    for fn in (scatter, update):
        got = jax.jit(lambda a, b: base.on_bits(fn, a, b))(old, new)
        assert got.dtype == old.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jax.jit(fn)(old, new), np.float32))
