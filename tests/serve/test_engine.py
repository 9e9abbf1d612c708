"""The paged continuous-batching engine: a request's tokens are the Sampler's for its prompt alone, whatever
joins, leaves, is preempted or shares its prompt's pages; pages return at once; the decode step runs over the
running rows; the jitted pieces against plain references. (The scheduling itself, on a fake runner:
test_scheduler.py; Huginn and real clients: test_server.py.)"""

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
from rq_jax.serve import model_runner, programs, sizing
from rq_jax.serve.sizing import DEFAULT_MAX_ROWS, default_page_size
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.tokenizer import load_tokenizer

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "checkpoints"
#: Retrieval prompts in the models' format (checkpoints/*/README.md): one 22-token context, three queries.
RETRIEVAL = ["q5;B1;m9;x3;a7;Z0;k2;\nx", "q5;B1;m9;x3;a7;Z0;k2;\nB", "q5;B1;m9;x3;a7;Z0;k2;\nm"]


def load(name: str):
    model, _ = checkpoint.load(SHIPPED / name)
    tokenizer = load_tokenizer(SHIPPED / name)
    return model, tokenizer, cli.stop_token_ids(tokenizer, str(SHIPPED / name))


def additions(tokenizer, n: int) -> list[list[int]]:
    """Held-out sums in the models' format (12 tokens each)."""
    return [tokenizer.encode(tokenizer.decode(list(e.prompt()))).ids for e in Addition().examples("eval", n)]


def metric(metrics: ServeMetrics, name: str, cache: str) -> float:
    return metrics.registry.get_sample_value("rq_serve_" + name, {"model": "ouro-small", "cache": cache})


@pytest.mark.parametrize("cache", ["dense", "residual", "kivi", "share", "turboquant"])
def test_greedy_tokens_equal_the_samplers_whatever_joins_leaves_is_preempted_or_shared(cache):
    """Nine prompts (six sums, three retrieval queries on one 22-token context) on a pool of 16 pages of 4
    tokens (room for two requests of 32) with up to six decoding and 8-token prompt chunks: five arrive
    first, four while those decode; pages run out (the latest arrival is preempted and recomputed), and the
    later queries find the context's two full chunks in the prefix index. Each request's tokens equal the
    Sampler's for its prompt alone (in the same 8-token chunks), and no page is held afterwards. (kivi's
    pages are whole rows: two requests run at once, each on its page, and nothing is shared.)"""
    model, tokenizer, stops = load("ouro-small")
    fmt = get_format(cache)
    metrics = ServeMetrics("ouro-small", cache)
    engine = Engine(model, tokenizer, fmt, eos_ids=stops, max_len=32, num_slots=2, max_rows=6, page_size=4,
                    chunk=8, token_budget=16, metrics=metrics)
    assert engine.num_pages == (2 if cache == "kivi" else 16) and engine.runner.decode_rows == (1, 2, 3, 4, 6)
    engine.warm_up()
    sums = additions(tokenizer, 6)
    prompts = sums[:4] + [tokenizer.encode(RETRIEVAL[0]).ids] + sums[4:] + [tokenizer.encode(q).ids
                                                                           for q in RETRIEVAL[1:]]
    params = [SamplingParams(max_tokens=8, seed=i) for i in range(len(prompts))]
    collected = {}

    def add(prompt, p):
        return engine.add_request(prompt, p, sink=lambda d: collected.setdefault(d.request_id, []).append(d))

    ids = [add(p, q) for p, q in zip(prompts[:5], params[:5])]
    finished = []
    for step in range(300):
        if step == 3:  # later arrivals join a running batch
            ids += [add(p, q) for p, q in zip(prompts[5:], params[5:])]
        finished += engine.step()
        engine.scheduler.check()
        if not engine.has_work() and len(ids) == len(prompts):
            break
    assert sorted(r.id for r in finished) == sorted(ids) and not engine.has_work()
    assert engine.scheduler.pool.held == 0 and metric(metrics, "pages_used", cache) == 0
    if cache == "kivi":
        assert metric(metrics, "prefix_cache_hit_tokens", cache) == 0 and engine.scheduler.cache_key is None
    else:
        assert metric(metrics, "preemptions_total", cache) >= 1
        assert metric(metrics, "prefix_cache_hit_tokens", cache) >= 2 * 16  # two later queries, two chunks each
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops, prefill_chunk=8), fmt)
    for rid, prompt, p in zip(ids, prompts, params):
        ref = sampler([prompt], seed=p.seed)
        want = ref.tokens[0, : int(ref.num_generated[0])].tolist()
        got = [t for d in collected[rid] for t in d.tokens]
        assert got == want, (rid, got, want)
        assert "".join(d.text for d in collected[rid]) == tokenizer.decode([t for t in want if t not in stops])


def test_huginns_random_state_shares_pages_only_between_requests_of_one_seed():
    """Huginn draws its initial state from each request's seed, so a page's K/V depend on the seed as well as
    the tokens: the same 29-token prompt under seeds 0, 1, 0 — the second computes its whole prompt, the third
    shares the first's three full chunks — and each gets the Sampler's tokens for its prompt and seed. Both
    run 6 of the model's 8 recurrence steps, given by the reference's name (`num_steps`): the pool holds 6
    loops and every call runs 6."""
    model, tokenizer, stops = load("huginn-small")
    fmt = get_format("residual")
    engine = Engine(model, tokenizer, fmt, eos_ids=stops, max_len=40, num_slots=2, page_size=4, chunk=8,
                    token_budget=16, init_scale=1.0, num_steps=6)
    assert model.config.num_loops == 8 and engine.num_loops == 6
    assert engine.runner.template.num_loops == 6
    prompt = tokenizer.encode(RETRIEVAL[0][:-1] + "m9;B1;k").ids
    assert len(prompt) == 29
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4, stop_tokens=stops, prefill_chunk=8), fmt,
                      init_scale=1.0, num_steps=6)
    hits = []
    for seed in (0, 1, 0):
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=4, seed=seed))
        hits.append(engine.scheduler.prefix_hits)
        ref = sampler([prompt], seed=seed)
        assert list(out.tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist(), seed
    assert hits == [0, 0, 24]


@pytest.fixture(scope="module")
def ouro():
    model, tokenizer, stops = load("ouro-small")
    engine = Engine(model, tokenizer, get_format("dense"), eos_ids=stops, max_len=48, num_slots=16, chunk=16,
                    page_size=16)
    assert engine.runner.decode_rows == (1, 2, 3, 4, 6, 8, 12, 16) and engine.runner.token_buckets == (16,)
    engine.warm_up()
    return model, tokenizer, stops, engine


def test_warm_up_stops_between_programs(ouro):
    """Asked to stop (SIGTERM while warming up), the warm-up returns before its next program, not ready."""
    model, tokenizer, stops, _ = ouro
    engine = Engine(model, tokenizer, get_format("dense"), eos_ids=stops, max_len=48, num_slots=2, chunk=16,
                    page_size=16)
    asked = iter([False, True])  # the first program runs, then the stop comes
    seconds = engine.warm_up(stop=lambda: next(asked))
    assert list(seconds) == ["decode 1"] and not engine.ready


def test_chunked_prompt_and_seeded_sampling_equal_the_sampler(ouro):
    """A 29-token prompt runs in two chunks (16 + 13) that read each other from the cache, and seeded
    sampling with top-k and top-p draws what the Sampler draws for that prompt alone."""
    model, tokenizer, stops, engine = ouro
    long = tokenizer.encode("q5;B1;m9;x3;a7;Z0;k2;\nm9;B1;k").ids
    assert len(long) > engine.chunk
    short = additions(tokenizer, 1)[0]
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_k=5, top_p=0.8, seed=7)
    outs = engine.generate([long, short], [SamplingParams(max_tokens=4), sampled])
    cfg = SamplingConfig(max_new_tokens=4, stop_tokens=stops, prefill_chunk=16)
    ref = Sampler(model, cfg, get_format("dense"))([long])
    assert list(outs[0].tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.9, top_k=5, top_p=0.8, stop_tokens=stops)
    ref = Sampler(model, cfg, get_format("dense"))([short], seed=7)
    assert list(outs[1].tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()


def test_logprobs_stop_strings_and_prompt_logprobs(ouro):
    """Per-token log-probabilities are the model's log-softmax at the chosen token (their top entry the
    chosen token under greedy); a stop string cuts the text before it; prompt log-probabilities score
    every prompt token after the first against a plain forward pass, a chunk at a time."""
    model, tokenizer, stops, engine = ouro
    prompt = additions(tokenizer, 1)[0]
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=2))
    assert full.text == "423170" and full.finish_reason == "stop"
    assert all(lp.top[0][0] == lp.token and lp.top[0][1] == pytest.approx(lp.logprob) for lp in full.logprobs)
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=8, stop=("31",)))
    assert cut.text == "42" and cut.finish_reason == "stop"
    long = tokenizer.encode("q5;B1;m9;x3;a7;Z0;k2;\nm9;B1;k").ids  # two chunks
    for ids in (prompt, long):
        (echo,) = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=True, logprobs=1))
        logits = model(jnp.asarray([ids]), None).logits[0]
        want = jax.nn.log_softmax(logits, axis=-1)[np.arange(len(ids) - 1), ids[1:]]
        assert echo.prompt_logprobs[0] is None and len(echo.prompt_logprobs) == len(ids)
        got = [lp.logprob for lp in echo.prompt_logprobs[1:]]
        # The first chunk's positions see their own float32 K/V; later ones read the first chunk's from the
        # bf16 cache (relative error 2^-9 per value), which moves a log-probability by ~1e-3 of itself.
        np.testing.assert_allclose(got[: engine.chunk - 1], want[: engine.chunk - 1], atol=2e-4)
        np.testing.assert_allclose(got[engine.chunk - 1 :], want[engine.chunk - 1 :], rtol=5e-3, atol=2e-4)


def test_a_stop_string_found_while_the_next_step_runs_drops_its_row(ouro, monkeypatch):
    """A step's text is made while the next step runs, so the request whose text reaches a stop string ("31"
    at its 4th token) has a row in the step after: that row is dropped (no token, no chain key kept), the
    text and tokens are what they were alone, the request beside it gets the Sampler's tokens, and no page
    is held afterwards."""
    model, tokenizer, stops, engine = ouro
    prompts = additions(tokenizer, 2)
    (alone,) = engine.generate([prompts[0]], SamplingParams(max_tokens=8))
    launched, collected = [], []
    launch, collect = engine.runner.launch, engine.runner.collect

    def spy_launch(plan, rows):
        launched.append({c.seq for c in plan.prefill + plan.decode})
        return launch(plan, rows)

    def spy_collect(calls, rows):
        results, lost = collect(calls, rows)
        collected.append(set(results))
        return results, lost

    monkeypatch.setattr(engine.runner, "launch", spy_launch)
    monkeypatch.setattr(engine.runner, "collect", spy_collect)
    cut, other = engine.generate(prompts, [SamplingParams(max_tokens=8, stop=("31",)), SamplingParams(max_tokens=8)])
    assert cut.text == "42" and cut.finish_reason == "stop" and cut.tokens == alone.tokens[:4]
    seq = min(set().union(*launched))  # the first request's id
    assert sum(seq in s for s in launched) == 5 and sum(seq in s for s in collected) == 4
    ref = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops), get_format("dense"))([prompts[1]])
    assert list(other.tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()
    assert engine.scheduler.pool.held == 0 and not engine.runner._rng
    engine.scheduler.check()


def test_a_decode_step_runs_under_one_and_a_half_times_its_rows():
    """`row_counts`: ascending, ending at the engine's most rows, and every step of n ≥ 2 rows runs in a
    compiled count under 1.5·n (1 runs as 1)."""
    assert sizing.row_counts(1) == (1,) and sizing.row_counts(6) == (1, 2, 3, 4, 6)
    assert sizing.row_counts(100)[-3:] == (64, 96, 100)
    for hi in (2, 7, 64, 100, 512):
        counts = sizing.row_counts(hi)
        assert list(counts) == sorted(set(counts)) and counts[-1] == hi
        assert sizing.holding(counts, 1) == 1
        assert all(sizing.holding(counts, n) < 1.5 * n for n in range(2, hi + 1)), hi


def test_prompt_chunks_run_in_calls_of_their_widths_and_few_padding_rows():
    """`prefill_groups` puts every chunk in one call that holds it (a compiled row count, a width at least its
    length), and its calls cost what the cheapest split of the widths into runs costs (every split tried,
    `call_sizes` within a run): twelve-token prompts beside a 200-token one run in a 16-token call of their
    own, a 20- and a 12-token one share a call, nine sums run as 8 + 1 rows, fifteen in one call of 16."""
    buckets = sizing.geometric(16, 256, 2)
    rows = {t: sizing.geometric(1, max(1, 2048 // t), 2) for t in buckets}

    def width(n):
        return next(t for t in buckets if t >= n)

    calls = sizing.prefill_groups([200] + [12] * 10, buckets, rows)
    assert sorted(map(len, calls[:-1])) == [2, 8] and calls[-1] == [0], calls
    assert sizing.prefill_groups([20, 12], buckets, rows) == [[1, 0]]
    assert [len(g) for g in sizing.prefill_groups([12] * 9, buckets, rows)] == [8, 1]
    assert [len(g) for g in sizing.prefill_groups([12] * 15, buckets, rows)] == [15]
    assert sizing.prefill_groups([], buckets, rows) == []
    # 3,000 chunks on a runner of at most 2 rows: 1,500 calls (built up, not recursed 1,500 deep)
    assert sizing.call_sizes(3000, 16, (1, 2))[1] == (2,) * 1500
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 257, rng.integers(1, 40)).tolist()
        calls = sizing.prefill_groups(lengths, buckets, rows)
        assert sorted(i for g in calls for i in g) == list(range(len(lengths)))
        cost = 0
        for g in calls:
            w = max(width(lengths[i]) for i in g)
            cost += sizing.CALL_TOKENS + next(r for r in rows[w] if r >= len(g)) * w
        widths = sorted({width(n) for n in lengths})
        best = min(sum(sizing.call_sizes(sum(width(n) in run for n in lengths), max(run), rows[max(run)])[0]
                       for run in runs)
                   for cuts in range(2 ** (len(widths) - 1))
                   for runs in [np.split(widths, [k + 1 for k in range(len(widths) - 1) if cuts >> k & 1])])
        assert cost == best, (lengths, calls)


def test_prompts_of_many_widths_in_one_step_equal_the_sampler():
    """An 86-token prompt (chunks of 64 and 22), a 23-token one and three sums arrive together: their first
    chunks run in calls of different widths in one step, and every request's tokens are the Sampler's. (A
    dense cache: what is tested is the scheduling, and the residual format compiles each program 3-4x slower;
    the exactness tests above cover the formats.)"""
    model, tokenizer, stops = load("ouro-small")
    engine = Engine(model, tokenizer, get_format("dense"), eos_ids=stops, max_len=128, num_slots=5, chunk=64,
                    page_size=16)
    assert engine.runner.token_buckets == (16, 32, 64)
    steps, call, launch = [], engine.runner._call, engine.runner.launch

    def spy(params, calib, state, tokens, *args, prefill, echo):
        if prefill:
            steps[-1].append(tokens.shape[1])
        return call(params, calib, state, tokens, *args, prefill=prefill, echo=echo)

    def each_step(*args):
        steps.append([])
        return launch(*args)

    engine.runner._call, engine.runner.launch = spy, each_step
    prompts = [tokenizer.encode(RETRIEVAL[0][:-2] * 4 + "\nx").ids, tokenizer.encode(RETRIEVAL[1]).ids,
               *additions(tokenizer, 3)]
    assert [len(p) for p in prompts] == [86, 23, 12, 12, 12]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert 64 in steps[0] and min(steps[0]) < 64, steps  # the sums not padded to the long prompt's 64
    sampler = Sampler(model, SamplingConfig(max_new_tokens=6, stop_tokens=stops, prefill_chunk=64),
                      get_format("dense"))
    for prompt, out in zip(prompts, outs):
        ref = sampler([prompt])
        assert list(out.tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()
    assert engine.scheduler.pool.held == 0


def test_a_calls_results_come_back_packed_bit_for_bit():
    """`pack` puts a call's picks, chain keys and lost values in one uint32 array; `unpack` gives them back
    bit for bit (NaN, -inf and negative ids included)."""
    n = programs.TOP_LOGPROBS
    rng = np.random.default_rng(0)
    logprob = np.array([-np.inf, np.nan, -0.0, -3.5], np.float32)
    picked = programs.Picked(np.array([0, -1, 258, 2**31 - 1], np.int32), logprob,
                             rng.integers(-5, 300, (4, n)).astype(np.int32), rng.normal(size=(4, n)).astype(np.float32))
    keys = rng.integers(0, 2**32, (4, 2), dtype=np.uint32)
    lost = np.array([0, 3, 0, 7], np.int32)
    packed = np.asarray(jax.jit(model_runner.pack)(picked, keys, lost))
    assert packed.dtype == np.uint32 and packed.shape == (4, 2 * n + 5)
    got, got_keys, got_lost = model_runner.unpack(packed)
    for want, have in zip((*picked, keys, lost), (*got, got_keys, got_lost)):
        assert have.dtype == want.dtype and have.tobytes() == np.ascontiguousarray(want).tobytes()


def test_cancel_frees_the_pages_at_once(ouro):
    _, tokenizer, _, engine = ouro
    seen = []
    rid = engine.add_request(additions(tokenizer, 1)[0], SamplingParams(max_tokens=30, stop_token_ids=()),
                             sink=seen.append)
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.scheduler.pool.held > 0
    assert engine.cancel(rid) and engine.num_running == 0 and engine.scheduler.pool.held == 0
    assert seen[-1].finish_reason == "cancelled" and not engine.cancel(rid)


def test_decode_steps_run_the_running_rows(ouro, monkeypatch):
    """Nine requests decode in steps of 12 rows (the smallest compiled size that holds them), whichever
    pages they hold; as they finish the steps shrink to 8, 6, 4 rows. Every request still gets the
    Sampler's tokens."""
    model, tokenizer, stops, engine = ouro
    sizes = []
    call = engine.runner._call

    def spy(params, calib, state, tokens, num_new, *args, prefill, echo):
        if not prefill:
            sizes.append((int((num_new > 0).sum()), tokens.shape[0]))
        return call(params, calib, state, tokens, num_new, *args, prefill=prefill, echo=echo)

    monkeypatch.setattr(engine.runner, "_call", spy)
    prompts = additions(tokenizer, 9)
    params = [SamplingParams(max_tokens=2 + i % 7) for i in range(9)]
    outs = engine.generate(prompts, params)
    assert (9, 12) in sizes and (4, 4) in sizes
    assert all(rows == min(r for r in engine.runner.decode_rows if r >= real) for real, rows in sizes), sizes
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops), get_format("dense"))
    for prompt, p, out in zip(prompts, params, outs):
        ref = sampler([prompt])
        assert list(out.tokens) == ref.tokens[0, : int(ref.num_generated[0])].tolist()[: p.max_tokens]
    assert engine.scheduler.pool.held == 0


def test_requests_that_cannot_be_served_are_refused_by_name(ouro):
    model, tokenizer, _, engine = ouro
    for prompt, params, field in [([], SamplingParams(), "prompt"), ([5, 900], SamplingParams(), "prompt"),
                                  ([5] * 40, SamplingParams(max_tokens=10), "max_tokens"),
                                  ([5], SamplingParams(stop_token_ids=(999,)), "stop_token_ids")]:
        with pytest.raises(ParamError) as err:
            engine.check(prompt, params)
        assert err.value.param == field
    for kwargs, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
                          (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature")]:
        with pytest.raises(ParamError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == field
    for kwargs, words in [(dict(memory_bytes=1000), "not one request of 64 tokens"),
                          (dict(), "give num_slots or memory_bytes"),
                          (dict(num_slots=0), "num_slots must be ≥ 1, got 0"),
                          (dict(num_slots=2, chunk=32, token_budget=16), "must hold a prompt chunk (32)")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            Engine(model, tokenizer, **{"fmt": get_format("dense"), "max_len": 64, "page_size": 16, **kwargs})


def test_a_format_that_needs_data_wants_its_calibration():
    """residual_vq's codebooks are fitted on data: without a calibration the engine refuses it by name."""
    model, tokenizer, stops = load("ouro-small")
    with pytest.raises(ValueError, match="needs a calibration fitted on data"):
        Engine(model, tokenizer, get_format("residual_vq"), eos_ids=stops, max_len=32, num_slots=1)


def test_pages_follow_the_memory_budget_and_the_formats_bytes():
    """At one budget the residual [2,2,2,4] pool holds about 5x dense bf16's pages; a page of the CPU's
    default 64 tokens is a quarter of a 256-token row's bytes, and the pool's arrays take exactly pages × page
    bytes."""
    model, tokenizer, _ = load("ouro-small")
    budget = 2**24
    engines = {name: Engine(model, tokenizer, get_format(name), max_len=256, memory_bytes=budget)
               for name in ("dense", "residual")}
    for name, engine in engines.items():
        row = cache_bytes(model.config, get_format(name), 256, num_loops=4).total
        assert engine.page_size == default_page_size() == 64
        assert engine.page_bytes * 4 == row and engine.num_pages == budget // engine.page_bytes
        pool = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.state))
        assert pool == engine.num_pages * engine.page_bytes, name
        assert engine.max_rows == min(DEFAULT_MAX_ROWS, engine.num_pages)
    assert cache_bytes(model.config, get_format("dense"), 64, num_loops=4).total == cache_nbytes(
        init_cache(model.config, 1, 64, get_format("dense")))
    ratio = engines["residual"].num_pages / engines["dense"].num_pages
    assert 4.5 <= ratio <= 5.5, ratio


def test_per_row_sampling_matches_the_samplers_choice():
    """Per-row sampling at temperature 0 is the argmax and, per row with its own key, the Sampler's
    choose_tokens on that row alone; rows with distinct keys draw distinct tokens."""
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    keys = jax.random.split(jax.random.key(2), 3)
    reference = jax.jit(choose_tokens, static_argnums=2)
    # Mixed rows; every row greedy (no draw runs); sampled rows without filters (no sort runs).
    for cfgs in ([SamplingConfig(), SamplingConfig(temperature=0.7, top_k=4),
                  SamplingConfig(temperature=1.3, top_p=0.6)],
                 [SamplingConfig()] * 3,
                 [SamplingConfig(temperature=0.7), SamplingConfig(), SamplingConfig(temperature=1.3)]):
        rows = programs.Sampling(jnp.array([c.temperature for c in cfgs]), jnp.array([c.top_k for c in cfgs]),
                                 jnp.array([c.top_p for c in cfgs]))
        picked = jax.jit(programs.choose)(logits, rows, keys)
        for b, cfg in enumerate(cfgs):
            assert int(picked.tokens[b]) == int(reference(logits[b : b + 1], keys[b], cfg)[0]), (cfgs, b)
        np.testing.assert_allclose(picked.logprob, jax.nn.log_softmax(logits)[np.arange(3), picked.tokens], rtol=1e-6)
    many = jax.vmap(programs.choose, (None, None, 0))(logits, rows, jax.vmap(lambda k: jax.random.split(k, 3))(
        jax.random.split(keys[0], 8)))
    assert len({int(t) for t in many.tokens[:, 0]}) > 1
