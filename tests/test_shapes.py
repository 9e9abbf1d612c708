"""The suite's shape checker (pyproject's `--jaxtyping-packages`, axis names of `rq_jax.shapes`): an
operand with two axes swapped fails at the annotated call that receives it."""

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from rq_jax.cache import base, get_format

B, T, H, K, S, D = 3, 1, 4, 2, 8, 16  # a decode step (T = 1); B, K, S and the 5 new tokens all differ


def _scores():
    scores = jax.random.normal(jax.random.key(0), (B, T, H, S))
    return scores, base.past_mask(jnp.array([3, 8, 5]), T, S)


def test_swapped_query_axes_broadcast_silently_and_the_checker_stops_them():
    """Scores laid out [B, H, T, S] instead of [B, T, H, S] broadcast against the mask [B, T, S] at T = 1,
    so unchecked the slip surfaces only as wrong numbers later: statistics [B, H, T] where [B, T, H]
    belong, which a merge with another partial broadcasts to [B, H, H]."""
    scores, mask = _scores()
    swapped = scores.transpose(0, 2, 1, 3)
    _, m, _ = base.softmax_partial.__wrapped__(swapped, mask)  # the function itself, unchecked
    assert m.shape == (B, H, T)
    with pytest.raises(TypeCheckError, match="scores"):
        base.softmax_partial(swapped, mask)
    _, m, _ = base.softmax_partial(scores, mask)
    assert m.shape == (B, T, H)


def test_a_slot_read_back_with_swapped_axes_is_refused():
    """Stored keys and values come back [B, K, S, D] (`SlotKV`); read as [B, S, K, D] they contradict the
    mask's S at the attention that takes them."""
    scores, mask = _scores()
    q = jax.random.normal(jax.random.key(2), (B, T, H, D))
    kv = jax.random.normal(jax.random.key(3), (B, K, S, D))
    assert base.dense_partial(q, kv, kv, mask).acc.shape == (B, T, H, D)
    bad = jnp.swapaxes(kv, 1, 2)
    with pytest.raises(TypeCheckError, match="dense_partial"):
        base.dense_partial(q, bad, bad, mask)


@pytest.mark.parametrize("swap", [(3, 4), (3, 5)], ids=["batch-kv_heads", "batch-tokens"])
def test_a_segment_with_swapped_axes_is_refused_at_write(swap):
    """A cache format's `write` takes a segment's K/V [G, p, N, B, K, T, D] with the rows' lengths [B]: a
    segment whose batch axis is swapped with another fails the check before anything is scattered."""
    fmt = get_format("dense", dtype="float32")
    seg = base.segments(1, fmt.group_len)[0]
    state = fmt.init(seg, 1, B, S, K, D)
    lengths, num_new = jnp.array([0, 3, 1]), jnp.array([5, 5, 2])
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, B, K, 5, D))
    written = fmt.write(state, k, k, lengths, num_new, None)
    assert written.state[0].k.shape == (1, 1, B, K, S, D)
    bad = jnp.swapaxes(k, *swap)
    with pytest.raises(TypeCheckError, match="write"):
        fmt.write(state, bad, bad, lengths, num_new, None)
