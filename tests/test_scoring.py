"""Eval loops through a cache: bookkeeping against the no-cache model, greedy equivalence with the
Sampler, one compile per batch shape, and the paired bootstrap."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rq_jax.cache import Dense, get_format
from rq_jax.data import Example
from rq_jax.scoring import CacheScorer, paired_bootstrap, paired_rows, score_examples, task_metrics
from rq_jax.sampling import Sampler, SamplingConfig


def rows(vocab, b=3, t=12, seed=0):
    tokens = np.random.default_rng(seed).integers(1, vocab, (b, t)).astype(np.int32)
    return tokens, np.array([3, 5, 1], np.int32)[:b], np.array([12, 9, 7], np.int32)[:b]


def test_dense_scores_equal_the_no_cache_forward(ouro):
    """Through a float32 dense cache every scored NLL equals the no-cache teacher-forced NLL; the
    format and the reference (the same dense cache, another fusion of the same sums) agree to float32
    re-association (measured ≤ 1.1e-6 relative); unscored positions stay zero."""
    model, _ = ouro
    tokens, prefix, lengths = rows(model.config.vocab_size)
    s = CacheScorer(model, Dense("float32"))(tokens, prefix, lengths)
    logits = model(jnp.asarray(tokens)).logits
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))
    pos = np.arange(12)
    expect = (pos >= prefix[:, None]) & (pos < lengths[:, None])
    np.testing.assert_array_equal(s.scored, expect)
    np.testing.assert_allclose(s.nll[:, 1:][expect[:, 1:]], nll[expect[:, 1:]], atol=2e-5)
    np.testing.assert_allclose(s.nll, s.ref_nll, rtol=1e-5)
    assert np.all(s.agree[expect]) and np.all(np.abs(s.kl) <= 1e-5) and not s.nll[~expect].any()


@pytest.mark.parametrize("fmt", ["residual", "kivi"])
def test_exact_match_is_greedy_decoding_through_the_cache(ouro, fmt):
    """Answers set to the Sampler's own greedy tokens through the same format score exact match 1; a
    changed token is wrong from there on (its argmax no longer matches) and right before it."""
    model, _ = ouro
    fmt = get_format(fmt, group_size=8)
    prompts = np.random.default_rng(1).integers(1, model.config.vocab_size, (2, 6)).astype(np.int32)
    gen = Sampler(model, SamplingConfig(max_new_tokens=5), fmt)(prompts.tolist())
    examples = [Example("t", np.concatenate([p, g]), np.r_[np.zeros(6), np.ones(5)].astype(np.int32), b"")
                for p, g in zip(prompts, gen.tokens)]
    scorer = CacheScorer(model, fmt)
    scores, _, answer_id = score_examples(scorer, examples, 11, batch=2)
    assert np.all(scores.correct[answer_id > 0])
    assert task_metrics(scores, answer_id)["accuracy"] == 1.0 and task_metrics(scores, answer_id)["correct"] == "1 1"
    changed = examples[0].tokens.copy()
    changed[8] = (changed[8] + 1) % model.config.vocab_size
    scores, _, _ = score_examples(scorer, [Example("t", changed, examples[0].answer_id, b"")], 11, batch=2)
    assert np.all(scores.correct[0, 6:8]) and not scores.correct[0, 8]


def test_compiles_once_per_batch_shape(ouro):
    """Five examples in batches of 2 (the last padded) and rows of different prefixes: one program."""
    model, _ = ouro
    rng = np.random.default_rng(2)
    examples = [Example("t", rng.integers(1, 100, 4 + i).astype(np.int32),
                        np.r_[np.zeros(2 + i), np.ones(2)].astype(np.int32), b"") for i in range(5)]
    scorer = CacheScorer(model, get_format("residual", group_size=8))
    scores, tokens, answer_id = score_examples(scorer, examples, 10, batch=2)
    assert scorer.num_compiled() == 1 and scores.nll.shape == (5, 10)
    assert np.array_equal(scores.scored, answer_id > 0)  # prefix = prompt, so exactly the answers


def test_data_fitted_formats_calibrate_per_batch(ouro):
    model, _ = ouro
    tokens, prefix, lengths = rows(model.config.vocab_size, t=12)
    s = CacheScorer(model, get_format("residual_vq"))(tokens, prefix, lengths)
    assert np.all(np.isfinite(s.kl)) and s.kl[s.scored].max() > 0


def test_bad_rows_are_rejected(ouro):
    model, _ = ouro
    tokens, prefix, lengths = rows(model.config.vocab_size)
    with pytest.raises(ValueError, match="1 ≤ prefix ≤ length"):
        CacheScorer(model, Dense("float32"))(tokens, prefix, lengths + 1)


def test_paired_bootstrap():
    a, b = np.array([1, 1, 0, 1] * 25), np.array([1, 0, 0, 1] * 25)
    diff, lo, hi = paired_bootstrap(a, b)
    assert diff == 0.25 and lo < 0.25 < hi and hi - lo < 0.4
    assert paired_bootstrap(a, a) == (0.0, 0.0, 0.0)
    # grouped: each group's pairs move together, so groups that differ only internally cancel exactly
    assert paired_bootstrap([1, 0, 1, 0], [0, 1, 0, 1], groups=[0, 0, 1, 1]) == (0.0, 0.0, 0.0)


def test_paired_rows_resample_whole_examples():
    """Two rows' per-example outcome words compare as the grouped bootstrap of their answers; rows of
    other answers are refused."""
    a, b = "1101 1111 0 10", "1001 1110 1 10"
    flat = [np.array([c == "1" for c in w.replace(" ", "")]) for w in (a, b)]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3]
    assert paired_rows(a, b) == paired_bootstrap(*flat, groups=groups)
    assert paired_rows(a, a) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="different answers"):
        paired_rows(a, "1101 1111 01")


def test_pareto_front_keeps_each_cost_s_best():
    from rq_jax.eval.table import pareto_front

    points = [(16, 98.2), (4, 0.0), (3.19, 86.1), (4.5, 94.1), (2.69, 84.0), (3.19, 80.0), (6.25, 96.8), (12, 97.8)]
    assert pareto_front(points) == [(2.69, 84.0), (3.19, 86.1), (4.5, 94.1), (6.25, 96.8), (12, 97.8), (16, 98.2)]
