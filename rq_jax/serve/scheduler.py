"""The serving engine's planner: which tokens of which requests run in the next step, and where their K/V
live. It owns the requests' states, the page pool and the prefix index, and nothing else: no arrays, no
model, no text. A step is planned by `schedule()` (a `StepPlan`), run by the model runner, and its sampled
tokens come back through `update()`; the output processor decides when a request is finished (`finish`).

Pages. The cache is a pool of pages of `page_size` tokens (`rq_jax.serve.pages.PagePool`: free, held by
reference count, or cached under a prefix hash); a request holds the pages its tokens fill, in order (its
block table), so its memory follows its length.

Steps. Every running request decoding advances one token per step; prompts run in chunks of at most
`chunk` tokens, and a prompt's chunks always start at multiples of `chunk`, so that a prompt's K/V (and
the tokens the model picks) do not depend on how its chunks were scheduled around other requests. A
step's tokens are bounded by `token_budget`: decode tokens first, then prompt chunks, the oldest requests
first. A request is admitted when its next chunk's pages can be had: from the free pages, then by
evicting cached ones.

Prefix caching. A waiting request's prompt is matched page by page against the index (the same tokens
from the first one on, the same format and calibration: `cache_key`); the matched pages are shared and
its prefill starts after them, at the last multiple of `chunk` they reach (the K/V of the pages after
that boundary would be computed with another chunking, so they are recomputed rather than shared), and
at least one prompt token is always computed (its logits pick the first output token).

Preemption by recompute. When a running request needs a page for its next token and none can be had,
the most recently arrived running request gives all its pages back and waits at the head of the queue.
Resumed, it runs its prompt in the same chunks, then its earlier output one token per step (`replay`),
so its cache — and every token it goes on to pick — is what it would have been without the preemption;
the tokens picked while replaying are discarded.

Shapes and sizes here are Python ints and lists: the runner turns a plan into arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Iterable

from rq_jax.serve.pages import PagePool, prefix_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """One request as the scheduler sees it: its tokens, how many of them have K/V in the cache, its pages."""

    id: int
    prompt: list[int]
    arrival: int  # admission order (preempted requests keep theirs)
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens of prompt + output whose K/V are stored
    pages: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose pages came from the prefix index (the last admission)
    hashes: list[bytes] | None = None  # the prefix hashes of its full prompt pages
    share: bool = True  # whether its prompt may start from indexed pages
    salt: str = ""  # what its pages' K/V depend on besides their tokens (a random initial state's seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One row of a step: tokens [start, start + len(tokens)) of a request, whose K/V go to `table`'s pages.
    `sample`: the row's last token is the request's last one, so the token the model picks after it is
    the request's next output token (otherwise the pick is discarded: a prompt chunk before the last, or a
    replayed token)."""

    seq: int
    start: int
    tokens: tuple[int, ...]
    table: tuple[int, ...]
    sample: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step: prompt chunks (`prefill`, any length up to the chunk size) and single tokens (`decode`), and
    the requests preempted to make room (their pages already free)."""

    prefill: tuple[Chunk, ...]
    decode: tuple[Chunk, ...]
    preempted: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.prefill + self.decode)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    """Plans steps over a page pool (the module docstring). `pages` is the pool's size, `page_size` tokens a
    page, `chunk` the prompt chunk (a multiple of `page_size` when prefixes are shared), `token_budget` the
    tokens of a step (at least `chunk`), `max_len` a request's longest prompt + output, `cache_key` what the
    prefix index is keyed by besides the tokens (None: no prefix caching)."""

    def __init__(self, pages: int, page_size: int, chunk: int, token_budget: int, max_len: int,
                 cache_key: str | None = None, max_running: int | None = None):
        if page_size < 1 or chunk < 1 or cache_key is not None and chunk % page_size:
            raise ValueError(f"the chunk ({chunk}) must be a positive multiple of the page size ({page_size}) "
                             "when prefixes are shared")
        if token_budget < chunk:
            raise ValueError(f"the token budget ({token_budget}) must hold a chunk ({chunk})")
        if pages * page_size < max_len:
            raise ValueError(f"{pages} pages of {page_size} tokens cannot hold one request of {max_len} tokens")
        self.pool = PagePool(pages)
        self.page_size, self.chunk, self.token_budget, self.max_len = page_size, chunk, token_budget, max_len
        self.cache_key = cache_key
        self.max_running = max_running
        self.seqs: dict[int, Sequence] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []  # in arrival order
        self._arrivals = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found in the index

    # ---- requests ------------------------------------------------------------------------------------

    def add(self, seq_id: int, prompt: Iterable[int], share: bool = True, salt: str = "") -> None:
        """Queue a request (its prompt non-empty, at most `max_len` tokens with its output). Without `share`
        its whole prompt runs (the prompt's log-probabilities need every position); its pages are indexed
        for others either way. `salt`: what its K/V depend on besides the tokens (Huginn's random initial
        state: the request's seed), so that only requests of the same salt share pages."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if seq_id in self.seqs:
            raise ValueError(f"request {seq_id} is already scheduled")
        self.seqs[seq_id] = Sequence(seq_id, prompt, self._arrivals, share=share, salt=salt)
        self._arrivals += 1
        self.waiting.append(seq_id)

    def finish(self, seq_id: int) -> None:
        """End a request (stopped, cancelled or at its length): its pages are released, its state dropped."""
        seq = self.seqs.pop(seq_id)
        if seq.status is Status.WAITING:
            self.waiting.remove(seq_id)
        else:
            self.running.remove(seq_id)
        self._release(seq)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: every running request's next token or chunk (preempting the latest arrivals when
        pages run out), then waiting requests' first chunks while the budget and the pages last."""
        budget, prefill, decode, preempted = self.token_budget, [], [], []
        for seq_id in list(self.running):
            seq = self.seqs.get(seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._next_tokens(seq, budget)
            if n == 0:
                continue
            while not self._reserve(seq, seq.computed + n):
                victim = self.seqs[self.running[-1]]  # the latest arrival gives way, this one included
                self._preempt(victim)
                preempted.append(victim.id)
                prefill = [c for c in prefill if c.seq != victim.id]
                decode = [c for c in decode if c.seq != victim.id]
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            chunk = self._chunk(seq, n)
            (decode if n == 1 and seq.computed >= len(seq.prompt) else prefill).append(chunk)
            budget -= n
        while self.waiting and budget > 0 and (self.max_running is None or len(self.running) < self.max_running):
            seq = self.seqs[self.waiting[0]]
            if seq.computed == 0 and not seq.pages:
                self._match_prefix(seq)
            n = self._next_tokens(seq, budget)
            if n == 0 or not self._reserve(seq, seq.computed + n):
                self._release(seq)  # it holds nothing while it waits (its prefix is matched again)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq.id)
            self.running.sort(key=lambda i: self.seqs[i].arrival)
            prefill.append(self._chunk(seq, n))
            budget -= n
        return StepPlan(tuple(prefill), tuple(decode), tuple(preempted))

    def _next_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` the next step computes: its prompt's next chunk (up to the next multiple of
        `chunk`), else one token; 0 when the budget cannot hold it (a chunk is never split by the budget)."""
        total = len(seq.prompt) + len(seq.output)
        if seq.computed < len(seq.prompt):
            n = min(len(seq.prompt), (seq.computed // self.chunk + 1) * self.chunk) - seq.computed
        else:
            n = 1 if seq.computed < total else 0
        return n if n <= budget else 0

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        tokens = seq.tokens[seq.computed : seq.computed + n]
        return Chunk(seq.id, seq.computed, tuple(tokens), tuple(seq.pages),
                     seq.computed + n == len(seq.prompt) + len(seq.output))

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        """Hold pages for the first `tokens` tokens of `seq`; False (holding what it had) when they cannot be had."""
        need = -(-tokens // self.page_size) - len(seq.pages)
        if need > self.pool.available:
            return False
        for _ in range(need):
            seq.pages.append(self.pool.allocate())
        return True

    def _preempt(self, seq: Sequence) -> None:
        """`seq` gives its pages back and waits at the head of the queue, to recompute (and replay) them."""
        self.running.remove(seq.id)
        self._release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq.id)

    def _release(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.pool.release(page)
        seq.pages, seq.computed, seq.cached_tokens = [], 0, 0

    def _match_prefix(self, seq: Sequence) -> None:
        """Share the indexed pages of `seq`'s prompt prefix (at most up to the last chunk boundary before
        its last prompt token) and start its prefill after them."""
        if self.cache_key is None or not seq.share:
            return
        usable = (len(seq.prompt) - 1) // self.chunk * self.chunk  # a chunk boundary short of the last token
        self.prefix_queries += usable
        pages = []
        for key in self._hashes(seq)[: usable // self.page_size]:
            page = self.pool.share(key)
            if page is None:
                break
            pages.append(page)
        keep = len(pages) * self.page_size // self.chunk * self.chunk // self.page_size
        for page in pages[keep:]:
            self.pool.release(page)
        seq.pages, seq.computed = pages[:keep], keep * self.page_size
        seq.cached_tokens = seq.computed
        self.prefix_hits += seq.computed

    # ---- results -------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, picked: dict[int, int]) -> dict[int, int]:
        """Advance every row of `plan` (`picked`: the token chosen after each row's last token, by request);
        returns the new output tokens by request (rows that replay or end a non-final prompt chunk add
        none). Full prompt pages become indexed for prefix sharing."""
        new = {}
        for chunk in plan.prefill + plan.decode:
            seq = self.seqs.get(chunk.seq)
            if seq is None or seq.status is not Status.RUNNING or seq.computed != chunk.start:
                continue  # finished or preempted since the plan
            seq.computed += len(chunk.tokens)
            if self.cache_key is not None and chunk.start < len(seq.prompt):
                self._index_prompt_pages(seq)
            if chunk.sample:
                seq.output.append(picked[chunk.seq])
                new[chunk.seq] = picked[chunk.seq]
        return new

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """The prefix hashes of `seq`'s full prompt pages (computed once)."""
        if seq.hashes is None:
            seq.hashes = prefix_hashes(seq.prompt, self.page_size, self.cache_key + seq.salt)
        return seq.hashes

    def _index_prompt_pages(self, seq: Sequence) -> None:
        full = min(seq.computed, len(seq.prompt)) // self.page_size
        for page, key in zip(seq.pages[:full], self._hashes(seq)):
            self.pool.register(page, key)

    # ---- accounting ----------------------------------------------------------------------------------

    def tokens_held(self) -> int:
        """Tokens with K/V stored for the requests that hold pages (shared pages counted per request)."""
        return sum(self.seqs[i].computed for i in self.running)

    def check(self) -> None:
        """Raise AssertionError unless every page's count equals the requests holding it and every page is
        exactly one of free, cached or held (the invariants the tests lean on)."""
        self.pool.check(collections.Counter(p for s in self.seqs.values() for p in s.pages))
        for seq in self.seqs.values():
            assert len(seq.pages) >= -(-seq.computed // self.page_size), seq
            assert seq.status is Status.RUNNING or not seq.pages, seq
