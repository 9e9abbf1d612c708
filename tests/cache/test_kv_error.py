"""rq_jax.cache.kv_error.loop_similarity against closed-form cases."""

import jax
import jax.numpy as jnp
import numpy as np

from rq_jax.cache.kv_error import loop_similarity


def test_scaled_copies_orthogonal_and_group_anchors():
    """Loops of a group that are scaled copies of its last loop have cosine 1 and LS residual 0; one
    orthogonal to it has cosine 0 and residual 1; each group of 4 is measured against its own last loop."""
    anchor = jax.random.normal(jax.random.key(0), (1, 2, 1, 5, 8))  # [N, B, K, S, D]
    orth = jnp.roll(anchor, 1, axis=-1) * jnp.array([1.0, -1.0] * 4)
    orth = orth - jnp.sum(orth * anchor, -1, keepdims=True) / jnp.sum(anchor * anchor, -1, keepdims=True) * anchor
    group = jnp.stack([2.0 * anchor, orth, -0.5 * anchor, anchor])
    other = jax.random.normal(jax.random.key(1), (4, 1, 2, 1, 5, 8))
    k = jnp.concatenate([group, other])  # 8 loops: two groups of 4
    out = loop_similarity(k, k, 4)
    np.testing.assert_allclose(out["k_cos"][:4, 0], [1.0, 0.0, -1.0, 1.0], atol=1e-5)
    np.testing.assert_allclose(out["k_rel"][:4, 0], [0.0, 1.0, 0.0, 0.0], atol=1e-5)
    assert abs(out["k_cos"][7, 0] - 1.0) < 1e-6  # the second group's anchor, against itself
    assert 0.0 < out["k_rel"][4, 0] <= 1.0 and abs(out["k_cos"][4, 0]) < 0.6  # random vectors: far from the anchor
    np.testing.assert_array_equal(out["k_cos"], out["v_cos"])
