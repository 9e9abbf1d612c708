"""The dense cache and the one-path dataflow: ragged batches, chunked prefill, decode, GQA, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Dense, base, cache_nbytes, init_cache
from rq_jax.config import preset
from rq_jax.models import init_model

TOL = 1e-4


def test_merge_equals_softmax_over_all_keys():
    rng = np.random.default_rng(0)
    b, t, h, k, s, d = 2, 3, 4, 2, 7, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, k, s, d)) * 3, jnp.float32)
    vals = jnp.asarray(rng.normal(size=(b, k, s, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, t, s)) < 0.7).at[:, :, 0].set(True)
    whole = base.finalize(base.dense_partial(q, keys, vals, mask))
    split = base.merge(base.dense_partial(q, keys[:, :, :3], vals[:, :, :3], mask[..., :3]),
                       base.dense_partial(q, keys[:, :, 3:], vals[:, :, 3:], mask[..., 3:]))
    np.testing.assert_allclose(base.finalize(split), whole, atol=1e-6)
    # Reference: explicit softmax with kv heads repeated for GQA.
    kr, vr = jnp.repeat(keys, h // k, axis=1), jnp.repeat(vals, h // k, axis=1)
    scores = jnp.einsum("bthd,bhsd->bths", q, kr) / np.sqrt(d)
    p = jax.nn.softmax(jnp.where(mask[:, :, None], scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(whole, jnp.einsum("bths,bhsd->bthd", p, vr), atol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
    q = jnp.ones((1, 1, 2, 4))
    kv = jnp.ones((1, 2, 3, 4))
    out = base.finalize(base.dense_partial(q, kv, kv, jnp.zeros((1, 1, 3), bool)))
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_ragged_batch_rows_match_running_alone(family, request):
    model, ref = request.getfixturevalue(family)
    kw = dict(num_loops=4)
    prompts = [ref["input_ids"][0, :10], ref["input_ids"][1, :4]]
    padded = np.zeros((2, 10), np.int32)
    padded[0], padded[1, :4] = prompts
    out = model(jnp.asarray(padded), init_cache(model.config, 2, 16, Dense("float32"), num_loops=4),
                num_new=jnp.array([10, 4]), **kw)
    for row, prompt in enumerate(prompts):
        alone = model(jnp.asarray(prompt)[None], **kw).logits[0]
        assert float(jnp.max(jnp.abs(out.logits[row, : len(prompt)] - alone))) <= TOL
    np.testing.assert_array_equal(out.cache.lengths, [10, 4])
    # Padding is never written: row 1's slots past its length stay zero.
    assert not np.any(np.asarray(out.cache.dense_kv()[0][:, :, 1, :, 4:]))


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_chunked_prefill_and_decode_match_one_forward(family, request):
    """A second prompt turn and token-by-token decode read the cache exactly like one long forward."""
    model, ref = request.getfixturevalue(family)
    kw = dict(num_loops=4)
    ids = jnp.asarray(ref["input_ids"])
    full = model(ids, **kw).logits
    cache = init_cache(model.config, 2, 10, Dense("float32"), num_loops=4)
    first = model(ids[:, :4], cache, **kw)
    second = model(ids[:, 4:8], first.cache, **kw)
    got = [first.logits, second.logits]
    cache = second.cache
    for t in (8, 9):
        step = model(ids[:, t : t + 1], cache, **kw)
        got.append(step.logits)
        cache = step.cache
    assert float(jnp.max(jnp.abs(jnp.concatenate(got, axis=1) - full))) <= TOL
    np.testing.assert_array_equal(cache.lengths, [10, 10])


def test_gqa_ouro_cached_decode_matches_forward():
    config = preset("ouro-tiny").replace(num_kv_heads=2)
    model = init_model(config, seed=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 7)))
    full = model(ids).logits
    cache = model.init_cache(2, 8, Dense("float32"))
    out = model(ids[:, :6], cache)
    assert out.cache.dense_kv()[0].shape == (4, 2, 2, 2, 8, 16)  # heads are not repeated
    step = model(ids[:, 6:], out.cache)
    assert float(jnp.max(jnp.abs(step.logits[:, 0] - full[:, 6]))) <= TOL


def test_prompt_longer_than_cache_is_rejected(ouro):
    model, ref = ouro
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match="10 tokens do not fit in a cache of max_len 8"):
        model(jnp.asarray(ref["input_ids"]), cache)
    full = model(jnp.asarray(ref["input_ids"][:, :6]), cache).cache
    with pytest.raises(ValueError, match=r"exceed the cache's max_len 8"):
        model(jnp.asarray(ref["input_ids"][:, :3]), full)


def test_loop_count_must_match_the_cache(huginn):
    model, ref = huginn
    cache = model.init_cache(2, 16, num_loops=4)
    with pytest.raises(ValueError, match="cache was built for 4 loops, this call runs 2"):
        model(jnp.asarray(ref["input_ids"]), cache, num_steps=2)


def test_cache_longer_than_model_positions_is_rejected():
    with pytest.raises(ValueError, match="exceeds the model's max positions 256"):
        init_cache(preset("ouro-tiny"), 1, 512)


def test_unknown_format_and_bad_dtype():
    with pytest.raises(ValueError, match="unknown cache format 'int3'"):
        base.get_format("int3")
    with pytest.raises(ValueError, match="dense cache dtype must be"):
        Dense("float16")


def test_dense_nbytes_counts_the_arrays():
    config = preset("huginn-tiny")
    cache = init_cache(config, 3, 32, Dense("bfloat16"), num_loops=8)
    per_slot = 3 * 4 * 32 * 24 * 2 * 2  # batch · heads · positions · head_dim · (K, V) · bf16
    assert cache_nbytes(cache) == per_slot * (8 * 2 + 2)
    assert cache_nbytes(cache) == base.tree_nbytes((cache.looped, cache.plain))


def test_forward_jits_with_a_cache(ouro):
    from flax import nnx

    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"])
    step = nnx.jit(lambda m, t, c: m(t, c))
    out = step(model, ids[:, :6], model.init_cache(2, 8, Dense("float32")))
    np.testing.assert_allclose(out.logits, model(ids[:, :6]).logits, atol=TOL)
    np.testing.assert_array_equal(out.cache.lengths, [6, 6])
