"""The scheduler on a fake runner (no model): admission by pages, page accounting, chunked prefill under a
token budget, preemption and exact resume, prefix hits and eviction, fairness at a steady overload.

The fake model picks token (sum of all tokens so far · 31 + length) mod 97 after a row's last token; a
request's reference output is that model run greedily on its prompt alone. The runner also records every
row's boundaries, so the tests see that a prompt's chunks start at multiples of the chunk and that a
resumed request replays its output one token at a time."""

from __future__ import annotations

import random

import pytest

from rq_jax.serve.pages import PagePool, prefix_hashes
from rq_jax.serve.scheduler import Scheduler, Status


def pick(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(pick(tokens))
    return tokens[len(prompt):]


class FakeEngine:
    """Scheduler + fake runner + the output processor's one rule (finish at max_tokens)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.max_tokens: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.rows: dict[int, list[tuple[int, int, bool]]] = {}  # per request: (start, tokens, decode row)
        self.steps = 0
        self.finished_at: dict[int, int] = {}
        self.added_at: dict[int, int] = {}

    def add(self, seq_id: int, prompt: list[int], max_tokens: int, share: bool = True, salt: str = "") -> None:
        self.sched.add(seq_id, prompt, share, salt)
        self.max_tokens[seq_id] = max_tokens
        self.outputs[seq_id] = []
        self.added_at[seq_id] = self.steps

    def cancel(self, seq_id: int) -> None:
        self.sched.finish(seq_id)
        self.max_tokens.pop(seq_id)

    def step(self) -> None:
        plan = self.sched.schedule()
        self.sched.check()
        assert plan.tokens <= self.sched.token_budget
        picked = {}
        for chunk, decode in [(c, False) for c in plan.prefill] + [(c, True) for c in plan.decode]:
            seq = self.sched.seqs[chunk.seq]
            known = seq.tokens[: chunk.start + len(chunk.tokens)]
            assert list(chunk.tokens) == known[chunk.start:]
            assert len(chunk.table) * self.sched.page_size >= chunk.start + len(chunk.tokens)
            self.rows.setdefault(chunk.seq, []).append((chunk.start, len(chunk.tokens), decode))
            picked[chunk.seq] = pick(known)
        for seq_id, token in self.sched.update(plan, picked).items():
            self.outputs[seq_id].append(token)
            if len(self.outputs[seq_id]) == self.max_tokens[seq_id]:
                self.sched.finish(seq_id)
                self.finished_at[seq_id] = self.steps
        self.sched.check()
        self.steps += 1

    def run(self, limit: int = 10_000) -> None:
        while self.sched.has_work():
            self.step()
            assert self.steps < limit, "the scheduler stopped making progress"


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_outputs_equal_each_prompt_alone_and_every_page_comes_back():
    sched = Scheduler(pages=64, page_size=4, chunk=8, token_budget=16, max_len=40)
    eng = FakeEngine(sched)
    batch = prompts(12, 1, 30)
    for i, p in enumerate(batch):
        eng.add(i, p, max_tokens=40 - len(p))
    eng.run()
    for i, p in enumerate(batch):
        assert eng.outputs[i] == reference(p, 40 - len(p))
    assert sched.pool.held == 0 and not sched.seqs


def test_prompt_chunks_start_at_multiples_of_the_chunk_within_the_budget():
    sched = Scheduler(pages=64, page_size=4, chunk=8, token_budget=12, max_len=64)
    eng = FakeEngine(sched)
    for i, p in enumerate(prompts(6, 9, 40, seed=1)):
        eng.add(i, p, max_tokens=3)
    eng.run()
    for i, rows in eng.rows.items():
        prompt_len = len(sched.seqs[i].prompt) if i in sched.seqs else None
        starts = [s for s, n, decode in rows if not decode]
        assert all(s % 8 == 0 for s in starts), rows
        assert all(n <= 8 for _, n, _ in rows)
        del prompt_len


def test_admission_takes_pages_as_chunks_need_them_and_never_overcommits():
    """A pool of 10 pages for three 20-token requests (5 pages each): each is admitted with its first chunk's
    pages, the pool is never overcommitted, requests wait or are preempted when it is full, and every
    output is right."""
    sched = Scheduler(pages=10, page_size=4, chunk=8, token_budget=64, max_len=20)
    eng = FakeEngine(sched)
    for i in range(3):
        eng.add(i, [i + 1] * 16, max_tokens=4)
    eng.step()
    assert sorted(sched.running) == [0, 1, 2] and sched.pool.held == 6  # one 8-token chunk (2 pages) each
    preempted = 0
    while sched.has_work():
        held = sched.pool.held
        assert held <= 10
        preempted += sum(s.preemptions for s in sched.seqs.values())
        eng.step()
    assert all(eng.outputs[i] == reference([i + 1] * 16, 4) for i in range(3))
    assert preempted > 0 and sched.pool.held == 0


def test_preemption_resumes_with_the_same_output():
    """Pages for 1.5 requests: the later one is preempted when the earlier needs pages, gives them back,
    recomputes its prompt in the same chunks and replays its output one token a step, then goes on with
    exactly the tokens it would have picked."""
    sched = Scheduler(pages=9, page_size=4, chunk=8, token_budget=32, max_len=36)
    eng = FakeEngine(sched)
    a, b = [3] * 10, [5] * 10
    eng.add(0, a, max_tokens=14)
    eng.add(1, b, max_tokens=14)
    eng.run()
    assert eng.outputs[0] == reference(a, 14) and eng.outputs[1] == reference(b, 14)
    assert eng.finished_at[0] < eng.finished_at[1]
    rows = eng.rows[1]
    starts = [i for i, (start, _, _) in enumerate(rows) if start == 0]
    assert len(starts) >= 2  # preempted at least once
    for first, end in zip(starts, starts[1:] + [len(rows)]):  # each run: the prompt in the same chunks, then
        run = rows[first:end]                                   # its output one token a step from the prompt's end
        assert [s for s, _, d in run if not d] == [0, 8]
        decode = [(s, n) for s, n, d in run if d]
        assert all(n == 1 for _, n in decode) and [s for s, _ in decode] == list(range(10, 10 + len(decode)))


def test_the_latest_arrival_gives_way():
    sched = Scheduler(pages=6, page_size=2, chunk=2, token_budget=8, max_len=12)
    eng = FakeEngine(sched)
    for i in range(3):
        eng.add(i, [i + 1, i + 2], max_tokens=10)
    preempted = []
    while sched.has_work():
        plan = sched.schedule()
        preempted += plan.preempted
        picked = {c.seq: pick(sched.seqs[c.seq].tokens[: c.start + len(c.tokens)]) for c in plan.prefill + plan.decode}
        for seq_id, tok in sched.update(plan, picked).items():
            eng.outputs[seq_id].append(tok)
            if len(eng.outputs[seq_id]) == 10:
                sched.finish(seq_id)
        sched.check()
    assert preempted and preempted[0] == 2  # request 2, the latest, goes first
    assert all(eng.outputs[i] == reference([i + 1, i + 2], 10) for i in range(3))


def test_prefix_pages_are_shared_and_skip_their_prefill():
    """A second request with the same 20-token prefix shares the first's pages up to the chunk boundary (16
    tokens) and computes only from there; its output is the prompt's alone. Pages no request holds stay
    cached, and are evicted (least recently released first) when the pool needs them."""
    sched = Scheduler(pages=16, page_size=4, chunk=8, token_budget=64, max_len=32, cache_key="fmt")
    eng = FakeEngine(sched)
    shared = list(range(20))
    eng.add(0, shared + [50, 51], max_tokens=2)
    eng.run()
    assert sched.pool.held == 0 and len(sched.pool.cached) == 5  # the 5 full prompt pages, indexed
    eng.add(1, shared + [60], max_tokens=2)
    eng.step()
    assert eng.rows[1][0][0] == 16 and sched.seqs[1].cached_tokens == 16
    assert sched.prefix_hits == 16
    eng.run()
    assert eng.outputs[1] == reference(shared + [60], 2)
    # A stream of new prompts needs every page: the cached ones are evicted, oldest released first.
    for i, p in enumerate(prompts(4, 30, 30, seed=2)):
        eng.add(10 + i, p, max_tokens=2)
    eng.run()
    assert sched.pool.evictions > 0 and sched.pool.held == 0
    sched.check()


def test_prefix_hits_stop_short_of_the_last_prompt_token():
    """A prompt that is wholly an indexed prefix still computes a token (its logits pick the first output),
    from the last chunk boundary before its end."""
    sched = Scheduler(pages=16, page_size=4, chunk=8, token_budget=64, max_len=32, cache_key="fmt")
    eng = FakeEngine(sched)
    p = list(range(16))
    eng.add(0, p, max_tokens=1)
    eng.run()
    eng.add(1, p, max_tokens=3)
    eng.step()
    assert eng.rows[1][0][:2] == (8, 8)  # pages [0, 8) shared, the chunk [8, 16) computed again
    eng.run()
    assert eng.outputs[1] == reference(p, 3)


def test_a_request_that_does_not_share_computes_its_whole_prompt():
    """A request added with share=False (the prompt's log-probabilities need every position) runs from
    position 0 past indexed pages of its prefix; its full pages are indexed for later requests all the same."""
    sched = Scheduler(pages=16, page_size=4, chunk=8, token_budget=64, max_len=32, cache_key="fmt")
    eng = FakeEngine(sched)
    p = list(range(20))
    eng.add(0, p, max_tokens=1)
    eng.run()
    eng.add(1, p + [7], max_tokens=2, share=False)
    eng.step()
    assert eng.rows[1][0][0] == 0 and sched.prefix_hits == 0 and sched.seqs[1].cached_tokens == 0
    eng.run()
    assert eng.outputs[1] == reference(p + [7], 2)
    eng.add(2, p + [8], max_tokens=1)
    eng.step()
    assert eng.rows[2][0][0] == 16
    eng.run()


def test_requests_of_another_salt_share_nothing():
    """Pages are shared only between requests of the same salt (Huginn's random initial state: the seed)."""
    sched = Scheduler(pages=16, page_size=4, chunk=8, token_budget=64, max_len=32, cache_key="fmt")
    eng = FakeEngine(sched)
    p = list(range(20))
    eng.add(0, p, max_tokens=1, salt="/seed=1")
    eng.run()
    eng.add(1, p + [7], max_tokens=1, salt="/seed=2")
    eng.step()
    assert eng.rows[1][0][0] == 0 and sched.prefix_hits == 0
    eng.run()
    eng.add(2, p + [8], max_tokens=1, salt="/seed=1")
    eng.step()
    assert eng.rows[2][0][0] == 16 and sched.prefix_hits == 16
    eng.run()


def test_other_formats_share_nothing():
    pool_key_a = prefix_hashes(list(range(8)), 4, "residual-b2.2.2.4/calib-1")
    pool_key_b = prefix_hashes(list(range(8)), 4, "dense")
    assert pool_key_a != pool_key_b and len(pool_key_a) == 2
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "x")[1] != prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, "x")[1]


def test_cancelled_requests_give_their_pages_back():
    sched = Scheduler(pages=32, page_size=4, chunk=8, token_budget=32, max_len=32, cache_key="fmt")
    eng = FakeEngine(sched)
    for i, p in enumerate(prompts(5, 5, 20, seed=3)):
        eng.add(i, p, max_tokens=10)
    eng.step()
    eng.step()
    eng.cancel(1)
    eng.cancel(4)  # one running, one maybe still waiting
    eng.run()
    assert sched.pool.held == 0 and set(eng.finished_at) == {0, 2, 3}


def test_no_request_starves_at_a_steady_overload():
    """Twice as many requests arrive as the pool can hold, steadily: every one finishes, in arrival order
    give or take the running set, and no wait exceeds a bound of the queue's length times a request's time."""
    sched = Scheduler(pages=24, page_size=4, chunk=8, token_budget=24, max_len=24)
    eng = FakeEngine(sched)
    rng = random.Random(4)
    for i in range(60):
        p = [rng.randrange(97) for _ in range(rng.randint(4, 12))]
        eng.add(i, p, max_tokens=8)
        eng.step()
        eng.step()  # two steps per arrival: about twice what the pool serves
    eng.run()
    assert set(eng.finished_at) == set(range(60))
    waits = [eng.finished_at[i] - eng.added_at[i] for i in range(60)]
    assert max(waits) < 60 * 12
    order = sorted(range(60), key=lambda i: eng.finished_at[i])
    assert all(abs(pos - i) <= 10 for pos, i in enumerate(order))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="multiple of the page size"):
        Scheduler(pages=8, page_size=4, chunk=6, token_budget=8, max_len=8, cache_key="fmt")
    Scheduler(pages=8, page_size=4, chunk=6, token_budget=8, max_len=8)  # no prefix sharing: any chunk
    with pytest.raises(ValueError, match="must hold a chunk"):
        Scheduler(pages=8, page_size=4, chunk=8, token_budget=4, max_len=8)
    with pytest.raises(ValueError, match="cannot hold one request"):
        Scheduler(pages=2, page_size=4, chunk=8, token_budget=8, max_len=16)
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0)
    sched = Scheduler(pages=8, page_size=4, chunk=8, token_budget=8, max_len=16)
    with pytest.raises(ValueError, match="at least one prompt token"):
        sched.add(0, [])
    sched.add(0, [1])
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(0, [2])
    assert sched.seqs[0].status is Status.WAITING
