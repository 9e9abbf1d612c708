"""The sampler: one compilation per shape, sampling filters, stop tokens, batches, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Dense, default_calib, get_format
from rq_jax.sampling import Sampler, SamplingConfig, choose_tokens, prefill


def test_no_retrace_for_same_shapes_and_compile_time_apart(ouro):
    """One compilation per shape; the first call's compile seconds are reported apart from its run
    seconds, the second call compiles nothing; the repr is one short line (not the cache's arrays)."""
    model, ref = ouro
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4, temperature=0.7))
    first = sampler(ref["input_ids"].tolist(), seed=0)
    assert sampler.num_compiled() == 2  # prefill + decode loop
    second = sampler(ref["input_ids"][::-1].tolist(), seed=1)
    assert sampler.num_compiled() == 2
    # Compiling two programs takes far longer than 0.1 s (0.9-3 s here, with the machine's load); running them
    # again takes milliseconds.
    assert first.compile_seconds > 0.1 and second.compile_seconds == 0.0
    assert 0 < second.prefill_seconds < first.compile_seconds and 0 < second.decode_seconds < first.compile_seconds
    text = repr(second)
    assert text.startswith("Generation(tokens [2, 4], num_generated=[4, 4], dense cache of 14 positions (") and \
        "\n" not in text and len(text) < 200


def test_text_generator_applies_the_checkpoint_stop_ids():
    """Text in, text out: the shipped Huginn's answer to the sample sum, cut at the newline that its
    generation_config.json names as a stop id (the Sampler without stop ids runs on past it)."""
    from rq_jax import TextGenerator
    from rq_jax.cli import SAMPLE_PROMPT
    from tests.conftest import SHIPPED

    gen = TextGenerator(SHIPPED / "huginn-small", cache="dense", max_new_tokens=12)
    assert gen(SAMPLE_PROMPT) == "423170" and int(gen.last.num_generated[0]) == 7
    assert gen.tokenizer.decode(gen.last.tokens[0, :7].tolist()) == "423170\n"
    assert gen([SAMPLE_PROMPT, SAMPLE_PROMPT]) == ["423170", "423170"]
    with pytest.raises(ValueError, match="every prompt needs at least one character"):
        gen("")


def test_seeded_sampling_is_reproducible_and_seed_dependent(huginn):
    model, ref = huginn
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, temperature=1.5), num_loops=2)
    prompts = ref["input_ids"].tolist()
    a, b, c = sampler(prompts, seed=3), sampler(prompts, seed=3), sampler(prompts, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_random_initial_state_changes_huginn_output(huginn):
    model, ref = huginn
    zeros = Sampler(model, SamplingConfig(max_new_tokens=3), num_loops=2, init_scale=0.0, return_logits=True)
    rand = Sampler(model, SamplingConfig(max_new_tokens=3), num_loops=2, init_scale=1.0, return_logits=True)
    prompts = ref["input_ids"].tolist()
    assert not np.allclose(zeros(prompts).logits, rand(prompts).logits)
    np.testing.assert_array_equal(rand(prompts, seed=5).logits, rand(prompts, seed=5).logits)


def test_huginn_noise_is_drawn_per_row_and_token(huginn):
    """fold_in(fold_in(key, row), token): a row's initial state does not depend on the batch size, its
    batch-mates or the padded length; different rows and tokens get different noise."""
    model, _ = huginn
    e = jnp.zeros((3, 7, model.config.hidden_size))
    key = jax.random.key(11)
    full = np.asarray(model.initial_state(e, key, 1.0))
    np.testing.assert_array_equal(np.asarray(model.initial_state(e[:1, :4], key, 1.0)), full[:1, :4])
    np.testing.assert_array_equal(np.asarray(model.initial_state(e[:2, :5], key, 1.0)), full[:2, :5])
    assert not np.allclose(full[0], full[1]) and not np.allclose(full[0, 0], full[0, 1])
    np.testing.assert_allclose(full.std(), model.config.init_std * model.config.embed_scale, rtol=0.1)
    np.testing.assert_array_equal(np.asarray(model.initial_state(e, key, 0.0)), 0.0)


def test_huginn_output_does_not_depend_on_batch_mates(huginn):
    """At the default random init and a fixed seed, a prompt at batch position 1 generates the same
    beside a batch-mate of 3 tokens as beside one of 10 (a single draw over the whole batch made row
    1's noise depend on the padded length: tokens 123… vs 106…), and the same run twice. Zero init:
    see test_batch_of_different_prompt_lengths_matches_single_rows."""
    model, ref = huginn
    ids = ref["input_ids"].tolist()
    prompt = ids[0][:7]
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), Dense("float32"), num_loops=2, return_logits=True)
    short, long = sampler([ids[1][:3], prompt], seed=3), sampler([ids[1], prompt], seed=3)
    np.testing.assert_array_equal(short.tokens[1], long.tokens[1])
    np.testing.assert_allclose(short.logits[1], long.logits[1], atol=1e-4)  # two programs: re-association only
    np.testing.assert_array_equal(sampler([ids[1][:3], prompt], seed=3).logits, short.logits)  # reproducible


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = jax.random.normal(jax.random.key(0), (16, 50))
    greedy = choose_tokens(logits, jax.random.key(1), SamplingConfig())
    for cfg in (SamplingConfig(temperature=1.0, top_k=1), SamplingConfig(temperature=1.0, top_p=1e-6)):
        np.testing.assert_array_equal(choose_tokens(logits, jax.random.key(2), cfg), greedy)


def test_top_k_and_top_p_restrict_the_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    keys = jax.random.split(jax.random.key(0), 400)
    def draw(cfg):
        return np.array([int(choose_tokens(logits, k, cfg)[0]) for k in keys[:200]])
    assert set(draw(SamplingConfig(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draw(SamplingConfig(temperature=1.0, top_p=0.85))) == {0, 1, 2}  # 0.5 + 0.3 < 0.85


def test_stop_tokens_end_rows_independently(ouro):
    model, ref = ouro
    greedy = Sampler(model, SamplingConfig(max_new_tokens=6))(ref["input_ids"].tolist())
    stop = int(greedy.tokens[0, 1])  # row 0 emits it at step 1
    out = Sampler(model, SamplingConfig(max_new_tokens=6, stop_tokens=(stop,), pad_id=-1))(ref["input_ids"].tolist())
    first_stop = [int(np.argmax(row == stop)) if stop in row else 6 for row in greedy.tokens]
    for row in range(2):
        n = min(first_stop[row] + 1, 6)
        assert out.num_generated[row] == n
        np.testing.assert_array_equal(out.tokens[row, :n], greedy.tokens[row, :n])
        assert np.all(out.tokens[row, n:] == -1)


def test_batch_of_different_prompt_lengths_matches_single_rows(huginn):
    model, ref = huginn
    sampler = Sampler(model, SamplingConfig(max_new_tokens=5), num_loops=2, init_scale=0.0)
    prompts = [ref["input_ids"][0, :3].tolist(), ref["input_ids"][1].tolist()]
    batch = sampler(prompts)
    for row, prompt in enumerate(prompts):
        np.testing.assert_array_equal(batch.tokens[row], sampler([prompt]).tokens[0])


def test_generation_that_does_not_fit_is_rejected(ouro):
    model, _ = ouro
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="needs a cache of 12, but max_len is 10"):
        sampler([[1, 2, 3, 4, 5]], max_len=10)
    with pytest.raises(ValueError, match="at least one token"):
        sampler([[1, 2], []])


@pytest.mark.parametrize("kwargs,match", [(dict(max_new_tokens=0), "max_new_tokens"),
                                          (dict(temperature=-1.0), "temperature"),
                                          (dict(top_p=0.0), "top_p"),
                                          (dict(prefill_chunk=0), "prefill_chunk")])
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def _chunks_by_hand(model, tokens, cache, num_new, chunk, **kwargs):
    """`prefill`'s chunked calls made one at a time: (logits at each row's last token, final cache)."""
    logits = np.zeros((tokens.shape[0], model.config.vocab_size), np.float32)
    padded = jnp.pad(tokens, ((0, 0), (0, -tokens.shape[1] % chunk)))
    for i in range(padded.shape[1] // chunk):
        here = jnp.clip(num_new - i * chunk, 0, chunk)
        out = model(padded[:, i * chunk:(i + 1) * chunk], cache, num_new=here, last_only=True, **kwargs)
        ends = np.asarray((here > 0) & (num_new <= (i + 1) * chunk))
        logits[ends], cache = np.asarray(out.logits)[ends], out.cache
    return logits, cache


@pytest.mark.parametrize("held", ["values", "bits"])
def test_a_long_prompt_prefills_chunk_by_chunk(ouro, held):
    """Past `chunk` tokens a prompt runs one chunk per model call: into a float32 dense cache that is one
    call's logits and K/V to float rounding; into a residual cache it is the same calls made by hand (the
    later chunks read the earlier ones quantized); the cache comes back held as it came."""
    model, _ = ouro
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, model.config.vocab_size)
    num_new = jnp.asarray([40, 23])
    empty = model.init_cache(2, 48, Dense("float32"))
    empty = empty if held == "values" else empty.as_bits()
    one = prefill(model, tokens, empty, num_new=num_new, chunk=None)
    chunked = prefill(model, tokens, empty, num_new=num_new, chunk=16)
    assert (chunked.cache.bit_dtypes is None) == (held == "values")
    np.testing.assert_allclose(chunked.logits, one.logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(chunked.cache.lengths, [40, 23])
    for a, b in zip(one.cache.as_values().dense_kv(), chunked.cache.as_values().dense_kv()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)

    fmt = get_format("residual", group_size=8)
    empty = model.init_cache(2, 48, fmt)
    calib = default_calib(empty)
    chunked = prefill(model, tokens, empty, num_new=num_new, chunk=16, calib=calib)
    logits, cache = _chunks_by_hand(model, tokens, empty, num_new, 16, calib=calib)
    np.testing.assert_allclose(chunked.logits, logits, rtol=2e-5, atol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(chunked.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_sampler_prefills_a_long_prompt_in_chunks(ouro):
    """Greedy generation with prefill_chunk below the prompt's length equals one-call prefill's
    through a float32 dense cache."""
    model, _ = ouro
    prompts = [list(range(3, 43)), list(range(7, 30))]
    outs = [Sampler(model, SamplingConfig(max_new_tokens=4, prefill_chunk=chunk), Dense("float32"))(prompts)
            for chunk in (None, 16)]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
