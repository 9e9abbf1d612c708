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


def test_scheme_errors_rows_and_the_formats_that_do_not_fit():
    """Every scheme of the report at the group size, in its order: on loops close to one another the
    residual chain beats direct coding; a format these shapes do not suit (turboquant at head dim 24) is
    named, not a row."""
    from rq_jax.cache.kv_error import scheme_errors
    from rq_jax.cache.schemes import kv_error_labels

    shared = jax.random.normal(jax.random.key(0), (1, 1, 1, 8, 24))
    k = shared[None] + 0.1 * jax.random.normal(jax.random.key(1), (4, 1, 1, 1, 8, 24))
    log = []
    rows = {r["scheme"]: r for r in scheme_errors(k, k, 8, log=log.append)}
    unfit = [label for label in kv_error_labels(8) if label.startswith("vLLM turboquant")]
    assert list(rows) == [label for label in kv_error_labels(8) if label not in unfit] and unfit
    assert all(any(line.startswith(label) and "not for this model: turboquant" in line for line in log)
               for label in unfit)
    assert rows["[2,2,2,4] g8"]["k_nmse"] < rows["direct INT2 g8"]["k_nmse"]
    r = rows["direct INT2 g8"]
    assert r["bits"] == 4.0 and len(r["k_nmse_per_loop"]) == 4
    assert r["k_nmse"] == r["v_nmse"]  # K and V are the same here
    np.testing.assert_allclose(r["k_nmse"], np.mean(r["k_nmse_per_loop"]), rtol=1e-6)
