"""The continuous-batching engine: a request's tokens are the Sampler's for its prompt alone, whatever
joins or leaves the batch meanwhile; slots free at once; the jitted pieces against plain references."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax import checkpoint, cli
from rq_jax.cache import cache_bytes, cache_nbytes, get_format, init_cache
from rq_jax.data import Addition
from rq_jax.sampling import Sampler, SamplingConfig, choose_tokens
from rq_jax.serve import Engine, ParamError, SamplingParams
from rq_jax.serve import programs
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.text import TextStream
from rq_jax.tokenizer import load_tokenizer

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "checkpoints"


def load(name: str):
    model, _ = checkpoint.load(SHIPPED / name)
    tokenizer = load_tokenizer(SHIPPED / name)
    kwargs = dict(init_scale=1.0) if model.config.family == "huginn" else {}  # Huginn: random initial state
    return model, tokenizer, cli.stop_token_ids(tokenizer, str(SHIPPED / name)), kwargs


def additions(tokenizer, n: int) -> list[list[int]]:
    """Held-out sums in the models' format (12 tokens each)."""
    return [tokenizer.encode(tokenizer.decode(list(e.prompt()))).ids for e in Addition().examples("eval", n)]


@pytest.mark.parametrize("cache", ["dense", "residual", "kivi", "share", "turboquant"])
def test_greedy_tokens_equal_the_samplers_whatever_joins_or_leaves(cache):
    """Eight sums on three slots, four of them arriving while others decode (waiting ones enter together
    through batched prefills, two rows per pass): each request's tokens equal the Sampler's for that prompt alone, and
    every slot is free afterwards. (Huginn, whose random initial
    state draws from each request's seed, is tested the same way through the server with mixed prompt
    and output lengths: tests/serve/test_server.py.)"""
    model, tokenizer, stops, kwargs = load("ouro-small")
    fmt = get_format(cache)
    metrics = ServeMetrics("ouro-small", cache)
    engine = Engine(model, tokenizer, fmt, eos_ids=stops, max_len=32, num_slots=3, chunk=16, metrics=metrics,
                    prefill_group=2, **kwargs)  # the batched prefill runs groups of 2: one full, one half
    engine.warm_up()
    prompts = additions(tokenizer, 8)
    params = [SamplingParams(max_tokens=8, seed=i) for i in range(8)]
    collected = {}
    ids = [engine.add_request(p, q, sink=lambda d: collected.setdefault(d.request_id, []).append(d))
           for p, q in zip(prompts[:4], params[:4])]
    finished = []
    for step in range(200):
        if step == 2:  # later arrivals join a running batch
            ids += [engine.add_request(p, q, sink=lambda d: collected.setdefault(d.request_id, []).append(d))
                    for p, q in zip(prompts[4:], params[4:])]
        finished += engine.step()
        if not engine.has_work() and len(ids) == 8:
            break
    assert sorted(r.id for r in finished) == sorted(ids) and not engine.has_work()
    assert sorted(engine._free) == [0, 1, 2]
    entered = metrics.registry.get_sample_value("rq_serve_batch_prefill_requests_total",
                                                {"model": "ouro-small", "cache": cache})
    assert entered >= 3  # the first three entered together
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops), fmt, **kwargs)
    for rid, prompt, p in zip(ids, prompts, params):
        ref = sampler([prompt], seed=p.seed)
        want = ref.tokens[0, : int(ref.num_generated[0])].tolist()
        got = [t for d in collected[rid] for t in d.tokens]
        assert got == want, (rid, got, want)
        text = "".join(d.text for d in collected[rid])
        assert text == tokenizer.decode([t for t in want if t not in stops])


@pytest.fixture(scope="module")
def ouro():
    model, tokenizer, stops, _ = load("ouro-small")
    engine = Engine(model, tokenizer, get_format("dense"), eos_ids=stops, max_len=48, num_slots=32, chunk=16)
    assert engine.decode_buckets == (8, 32)
    engine.warm_up()
    return model, tokenizer, stops, engine


def test_warm_up_stops_between_programs(ouro):
    """Asked to stop (SIGTERM while warming up), the warm-up returns before its next program, not ready."""
    model, tokenizer, stops, _ = ouro
    engine = Engine(model, tokenizer, get_format("dense"), eos_ids=stops, max_len=48, num_slots=2, chunk=16)
    asked = iter([False, True])  # the first program runs, then the stop comes
    seconds = engine.warm_up(stop=lambda: next(asked))
    assert list(seconds) == ["prefill 16"] and not engine.ready


def test_chunked_prompt_and_seeded_sampling_equal_the_sampler(ouro):
    """A 28-token prompt runs in two chunks (16 + 12) that read each other at full precision, and seeded
    sampling with top-k and top-p draws what the Sampler draws for that prompt alone."""
    model, tokenizer, stops, engine = ouro
    long = tokenizer.encode("q5;B1;m9;x3;a7;Z0;k2;\nm9;B1;k").ids
    assert len(long) > engine.chunk
    short = additions(tokenizer, 1)[0]
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_k=5, top_p=0.8, seed=7)
    outs = engine.generate([long, short], [SamplingParams(max_tokens=4), sampled])
    ref = Sampler(model, SamplingConfig(max_new_tokens=4, stop_tokens=stops), get_format("dense"))([long])
    assert list(outs[0].tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.9, top_k=5, top_p=0.8, stop_tokens=stops)
    ref = Sampler(model, cfg, get_format("dense"))([short], seed=7)
    assert list(outs[1].tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()


def test_logprobs_stop_strings_and_prompt_logprobs(ouro):
    """Per-token log-probabilities are the model's log-softmax at the chosen token (their top entry the
    chosen token under greedy); a stop string cuts the text before it; prompt log-probabilities score
    every prompt token after the first against a plain forward pass."""
    model, tokenizer, stops, engine = ouro
    prompt = additions(tokenizer, 1)[0]
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=2))
    assert full.text == "423170" and full.finish_reason == "stop"
    assert all(lp.top[0][0] == lp.token and lp.top[0][1] == pytest.approx(lp.logprob) for lp in full.logprobs)
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=8, stop=("31",)))
    assert cut.text == "42" and cut.finish_reason == "stop"
    (echo,) = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True, logprobs=1))
    logits = model(jnp.asarray([prompt]), None).logits[0]
    want = jax.nn.log_softmax(logits, axis=-1)[np.arange(len(prompt) - 1), prompt[1:]]
    assert echo.prompt_logprobs[0] is None and len(echo.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose([lp.logprob for lp in echo.prompt_logprobs[1:]], want, atol=2e-4)


def test_cancel_frees_the_slot_at_once(ouro):
    _, tokenizer, _, engine = ouro
    seen = []
    rid = engine.add_request(additions(tokenizer, 1)[0], SamplingParams(max_tokens=30, stop_token_ids=()),
                             sink=seen.append)
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.cancel(rid) and engine.num_running == 0
    assert sorted(engine._free) == list(range(32)) and seen[-1].finish_reason == "cancelled"
    assert not engine.cancel(rid)


def test_decode_steps_run_the_fewest_leading_slots(ouro, monkeypatch):
    """Nine requests take slots 0-8, so the first decode step runs all 32 slots; once the one in slot 8
    (two tokens) is done, the steps run slots 0-7 alone. Every request still gets the Sampler's tokens."""
    model, tokenizer, stops, engine = ouro
    sizes = []
    decode = engine._decode

    def spy(params, calib, cache, slots, active):
        sizes.append(len(active))
        return decode(params, calib, cache, slots, active)

    monkeypatch.setattr(engine, "_decode", spy)
    prompts = additions(tokenizer, 9)
    params = [SamplingParams(max_tokens=2 if i == 8 else 8) for i in range(9)]
    outs = engine.generate(prompts, params)
    assert sizes[0] == 32 and set(sizes[1:]) == {8}, sizes
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops), get_format("dense"))
    for prompt, p, out in zip(prompts, params, outs):
        ref = sampler([prompt])
        assert list(out.tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()[: p.max_tokens]
    assert sorted(engine._free) == list(range(32))


def test_requests_that_cannot_be_served_are_refused_by_name(ouro):
    _, _, _, engine = ouro
    for prompt, params, field in [([], SamplingParams(), "prompt"), ([5, 900], SamplingParams(), "prompt"),
                                  ([5] * 40, SamplingParams(max_tokens=10), "max_tokens")]:
        with pytest.raises(ParamError) as err:
            engine.check(prompt, params)
        assert err.value.param == field
    for kwargs, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
                          (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature")]:
        with pytest.raises(ParamError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == field


def test_slots_follow_the_memory_budget_and_the_formats_bytes():
    """At one budget the residual [2,2,2,4] cache holds about 5x dense bf16's slots (the arrays' bytes)."""
    model, tokenizer, _, _ = load("ouro-small")
    budget = 2**24
    slots = {name: Engine(model, tokenizer, get_format(name), max_len=64, memory_bytes=budget).num_slots
             for name in ("dense", "residual")}
    dense_row = cache_bytes(model.config, get_format("dense"), 64, num_loops=4).total
    assert dense_row == cache_nbytes(init_cache(model.config, 1, 64, get_format("dense")))
    assert slots["dense"] == budget // dense_row
    assert 4.5 <= slots["residual"] / slots["dense"] <= 5.5, slots
    with pytest.raises(ValueError, match="hold no slot"):
        Engine(model, tokenizer, get_format("dense"), max_len=64, memory_bytes=1000)
    with pytest.raises(ValueError, match="prefill_rows must be ≥ 1, got 0"):
        Engine(model, tokenizer, get_format("dense"), max_len=64, num_slots=2, prefill_rows=0)
    with pytest.raises(ValueError, match="prefill_group must be ≥ 1, got 0"):
        Engine(model, tokenizer, get_format("dense"), max_len=64, num_slots=2, prefill_group=0)


def test_insert_rows_first_rows_and_per_slot_sampling_match_references():
    """insert_rows replaces exactly one batch row of every leaf and first_rows takes the leading rows;
    per-slot sampling at temperature 0 is the argmax and, per row with its own key, the Sampler's
    choose_tokens on that row alone."""
    model, *_ = load("ouro-small")
    fmt = get_format("residual")
    def caches():
        big = jax.tree_util.tree_map(lambda x: jnp.ones_like(x) if x.dtype != bool else x,
                                     init_cache(model.config, 3, 16, fmt))
        return big, init_cache(model.config, 1, 16, fmt).replace(lengths=jnp.array([5], jnp.int32))

    big, row = jax.jit(caches)()
    out = jax.jit(programs.insert_rows)(big, row, jnp.int32(1))
    for old, new in zip(jax.tree_util.tree_leaves((big.looped, big.plain)), jax.tree_util.tree_leaves(out.looped)):
        np.testing.assert_array_equal(np.asarray(new)[:, :, [0, 2]], np.asarray(old)[:, :, [0, 2]])
        assert not np.asarray(new)[:, :, 1].any()
    assert out.lengths.tolist() == [1, 5, 1]
    head = jax.jit(programs.first_rows, static_argnums=1)(out, 2)
    for new, part in zip(jax.tree_util.tree_leaves(out.looped), jax.tree_util.tree_leaves(head.looped)):
        np.testing.assert_array_equal(np.asarray(part), np.asarray(new)[:, :, :2])
    assert head.lengths.tolist() == [1, 5]
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    keys = jax.random.split(jax.random.key(2), 3)
    reference = jax.jit(choose_tokens, static_argnums=2)
    # Mixed rows; every row greedy (no draw runs); sampled rows without filters (no sort runs).
    for cfgs in ([SamplingConfig(), SamplingConfig(temperature=0.7, top_k=4),
                  SamplingConfig(temperature=1.3, top_p=0.6)],
                 [SamplingConfig()] * 3,
                 [SamplingConfig(temperature=0.7), SamplingConfig(), SamplingConfig(temperature=1.3)]):
        slots = programs.Slots(jnp.zeros(3, jnp.int32), jnp.array([c.temperature for c in cfgs]),
                               jnp.array([c.top_k for c in cfgs]), jnp.array([c.top_p for c in cfgs]), keys)
        picked = jax.jit(programs.choose)(logits, slots, keys)
        for b, cfg in enumerate(cfgs):
            assert int(picked.tokens[b]) == int(reference(logits[b : b + 1], keys[b], cfg)[0]), (cfgs, b)
        np.testing.assert_allclose(picked.logprob, jax.nn.log_softmax(logits)[np.arange(3), picked.tokens], rtol=1e-6)
    assert len({int(t) for t in jax.vmap(programs.choose, (None, None, 0))(
        logits, slots, jax.vmap(lambda k: jax.random.split(k, 3))(jax.random.split(keys[0], 8))).tokens[:, 0]}) > 1


class _Bytes:
    """A tokenizer whose ids are characters (decode joins them)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_text_stream_holds_back_possible_stop_strings():
    stream = TextStream(_Bytes(), stop=("END",))
    pieces = []
    for ch in "abcEN":
        assert not stream.add(ord(ch))
        pieces.append(stream.pending())
    assert "".join(pieces) == "abc"  # "EN" might start "END"
    assert stream.add(ord("D")) and stream.pending(final=True) == "" and stream.text == "abc"
