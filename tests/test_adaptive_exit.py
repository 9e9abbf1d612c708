"""Huginn adaptive exit: per-token freezing, latest-m4 cache fill, criteria, formats and the sampler.

Model calls run eagerly on the tiny fixture with a few shared shapes (batch 2; 4 core steps), so the
per-op compilations are reused across tests. Thresholds were chosen from the fixture's measured
criterion values (noted at each use) with wide margins.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rq_jax.cache as rq_cache
from rq_jax.cache import Dense
from rq_jax.nn.huginn import AdaptiveExit, _exit_fires, _ExitTracker
from rq_jax.sampling import Sampler, SamplingConfig

N = 4  # core steps everywhere (the tiny model's mean recurrence)
NEVER, ALWAYS = AdaptiveExit("kl", -1.0), AdaptiveExit("kl", 1e9)  # KL ≥ 0 < -1 never; < 1e9 at step 1


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def assert_caches_close(a, b):
    """Same lengths; K/V equal up to float32 re-association between two compiled programs (1e-5)."""
    np.testing.assert_array_equal(a.lengths, b.lengths)
    for x, y in zip(jax.tree_util.tree_leaves((a.looped, a.plain)), jax.tree_util.tree_leaves((b.looped, b.plain))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def assert_latest_m4(cache, steps_used, pos):
    """Dense looped slots at `pos`: row b's steps ≥ steps_used[b] repeat step steps_used[b] − 1 exactly."""
    for kv in cache.dense_kv():
        kv = np.asarray(kv[:, :, :, :, pos])  # [L, N, B, K, D]
        for b, used in enumerate(np.asarray(steps_used).reshape(-1)):
            for step in range(used, N):
                np.testing.assert_array_equal(kv[step, :, b], kv[used - 1, :, b])


@pytest.fixture(scope="module")
def prefix(huginn):
    """The reference prompts prefilled (all steps) in a float32 dense cache, and the greedy next token."""
    model, ref = huginn
    out = model(jnp.asarray(ref["input_ids"]), model.init_cache(2, 12, Dense("float32"), num_loops=N), num_steps=N)
    return out.cache, jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)


def test_nothing_exits_equals_the_full_recurrence(huginn, prefix):
    model, _ = huginn
    cache, token = prefix
    full = model(token, cache, num_steps=N)
    out = model(token, cache, num_steps=N, adaptive=NEVER)
    np.testing.assert_allclose(out.logits, full.logits, atol=1e-5)
    np.testing.assert_allclose(out.extras["latents"], full.extras["latents"], atol=1e-5)
    assert_caches_close(out.cache, full.cache)
    np.testing.assert_array_equal(out.extras["steps_used"], N)


def test_exit_after_first_step_is_one_step_and_fills_the_cache(huginn):
    model, ref = huginn
    cache = model.init_cache(2, 10, Dense("float32"), num_loops=N)
    out = model(jnp.asarray(ref["input_ids"]), cache, num_steps=N, adaptive=ALWAYS)
    np.testing.assert_array_equal(out.extras["steps_used"], 1)
    assert max_err(out.logits, ref["logits_r1"]) <= 1e-4  # every token stopped after step 1
    assert max_err(out.extras["latents"], ref["latents_r1"]) <= 1e-4
    k, v = out.cache.dense_kv()
    assert max_err(k[0, :, :, :, :10], np.stack([ref["k_idx1"], ref["k_idx2"]])) <= 1e-4
    for step in range(1, N):  # latest-m4: the missing steps hold step 0's K/V
        np.testing.assert_array_equal(k[step], k[0])
        np.testing.assert_array_equal(v[step], v[0])


def test_mixed_batch_rows_exit_independently(huginn):
    model, _ = huginn
    # Single tokens, no past. KL per step, token 88: .81 .16 .082 | token 0: .64 .35 .47 → with 0.1
    # token 88 exits after step 3, token 0 runs all 4.
    tokens = jnp.array([[88], [0]], jnp.int32)
    out = model(tokens, model.init_cache(2, 1, Dense("float32"), num_loops=N), num_steps=N,
                adaptive=AdaptiveExit("kl", 0.1))
    np.testing.assert_array_equal(out.extras["steps_used"], [[3], [N]])
    three = model(tokens, model.init_cache(2, 1, Dense("float32"), num_loops=3), num_steps=3)
    full = model(tokens, model.init_cache(2, 1, Dense("float32"), num_loops=N), num_steps=N)
    assert max_err(out.logits[0], three.logits[0]) <= 1e-5
    assert max_err(out.logits[1], full.logits[1]) <= 1e-5
    (k, _), (k3, _), (k4, _) = (c.cache.dense_kv() for c in (out, three, full))
    assert max_err(k[:3, :, 0], k3[:, :, 0]) <= 1e-5
    assert max_err(k[:, :, 1], k4[:, :, 1]) <= 1e-5
    coda = out.cache.dense_kv("plain")[0][:, 1, 0], three.cache.dense_kv("plain")[0][:, 1, 0]
    assert max_err(*coda) <= 1e-5  # coda of its exit state
    assert_latest_m4(out.cache, out.extras["steps_used"], 0)


@pytest.mark.parametrize("rule,expected", [
    (AdaptiveExit("entropy-diff", 0.05), [[2], [N]]),  # measured on the prefix's next token
    (AdaptiveExit("argmax-stability", 1), [[2], [N]]),
    (AdaptiveExit("argmax-stability", 0), [[1], [1]]),  # stable for 0 steps: exit after the first
])
def test_other_criteria_in_decode(huginn, prefix, rule, expected):
    model, _ = huginn
    cache, token = prefix
    out = model(token, cache, num_steps=N, adaptive=rule, last_only=True)
    np.testing.assert_array_equal(out.extras["steps_used"], expected)
    assert out.logits.shape == (2, 128)
    assert_latest_m4(out.cache, out.extras["steps_used"], 10)
    after = model(token, out.cache, num_steps=N)  # the next token reads the filled cache
    assert np.all(np.isfinite(after.logits))


def test_criteria_values():
    v = 4
    uniform = _ExitTracker(jnp.full((1, 1, v), -np.log(v)), jnp.full((1, 1), 100.0), jnp.full((1, 1), -1),
                           jnp.zeros((1, 1), jnp.int32))
    logits = jnp.log(jnp.array([[[0.7, 0.1, 0.1, 0.1]]]))
    p = np.array([0.7, 0.1, 0.1, 0.1])
    kl = np.sum(0.25 * (np.log(0.25) - np.log(p)))  # KL(uniform ‖ p)
    entropy = -np.sum(p * np.log(p))
    s0, s1 = jnp.zeros((1, 1, 3)), jnp.array([[[3.0, 0.0, 4.0]]])
    for rule, fires in [("kl", kl), ("entropy-diff", 100 - entropy), ("latent-diff", 1.0)]:
        assert bool(_exit_fires(AdaptiveExit(rule, fires + 1e-3), uniform, logits, s0, s1)[0][0, 0])
        assert not bool(_exit_fires(AdaptiveExit(rule, fires - 1e-3), uniform, logits, s0, s1)[0][0, 0])
    _, seen = _exit_fires(AdaptiveExit("kl"), uniform, logits, s0, s1)
    assert bool(_exit_fires(AdaptiveExit("kl", 1e-6), seen, logits, s0, s1)[0][0, 0])  # same distribution: KL 0
    rule, tracker = AdaptiveExit("argmax-stability", 2), uniform
    for step, fires in enumerate([False, False, True]):
        fired, tracker = _exit_fires(rule, tracker, logits, s0, s1)
        assert bool(fired[0, 0]) == fires and int(tracker.stable[0, 0]) == step


def test_works_with_a_quantized_format(huginn, prefix):
    model, ref = huginn
    names = rq_cache.available_formats()
    fmt = rq_cache.get_format("residual", group_size=8) if "residual" in names else Dense("bfloat16")
    ids, (_, token) = jnp.asarray(ref["input_ids"]), prefix
    empty = model.init_cache(2, 12, fmt, num_loops=N)
    calib = rq_cache.default_calib(empty)
    cache = model(ids, empty, num_steps=N, calib=calib).cache
    full = model(token, cache, num_steps=N, calib=calib)
    never = model(token, cache, num_steps=N, adaptive=NEVER, calib=calib)
    np.testing.assert_allclose(never.logits, full.logits, atol=1e-5)
    once = model(token, cache, num_steps=N, adaptive=ALWAYS, calib=calib)
    np.testing.assert_array_equal(once.extras["steps_used"], 1)
    k0, _ = once.cache.read("looped", 0, 0, calib)
    for step in range(1, N):  # what later tokens read back: every step holds (a coding of) step 0's K
        k, _ = once.cache.read("looped", step, 0, calib)
        assert max_err(k[:, :, 10], k0[:, :, 10]) <= 0.1 * float(np.max(np.abs(k0[:, :, 10])))
    after = model(token, once.cache, num_steps=N, calib=calib)
    assert np.all(np.isfinite(after.logits))


def test_sampler_reports_mean_steps_without_retracing(huginn, prefix):
    model, ref = huginn
    rule = AdaptiveExit("entropy-diff", 0.05)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=3), Dense("float32"), return_logits=True, num_steps=N,
                      init_scale=0.0, decode_kwargs=dict(adaptive=rule))
    gen = sampler(ref["input_ids"].tolist())
    assert 1 <= gen.mean_steps < N
    cache, token = prefix
    np.testing.assert_array_equal(gen.tokens[:, :1], token)
    first = model(token, cache, num_steps=N, adaptive=rule, last_only=True)
    assert max_err(gen.logits[:, 1], first.logits) <= 1e-4
    again = sampler(ref["input_ids"][::-1].tolist())
    assert sampler.num_compiled() == 2
    assert 1 <= again.mean_steps <= N


@pytest.mark.parametrize("kwargs,match", [(dict(criterion="cosine"), "'cosine'"),
                                          (dict(threshold=float("nan")), "finite")])
def test_bad_adaptive_exit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveExit(**kwargs)


def test_default_thresholds():
    assert AdaptiveExit().threshold == 5e-4
    assert AdaptiveExit("entropy-diff").threshold == 1e-3
    assert AdaptiveExit("argmax-stability").threshold == 5
