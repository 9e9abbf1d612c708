"""A continuous-batching engine over a paged cache of any format, in three rooms (vLLM v1's shape):

    scheduler        which tokens of which requests run next, the page pool, the prefix index
                     (`rq_jax.serve.scheduler`: no arrays, no text)
    model runner     the compiled programs over a step plan, the cache's pool, each request's PRNG chain
                     (`rq_jax.serve.model_runner`)
    output processor the picked tokens as text, stops, log-probabilities and metrics (`rq_jax.serve.output`)

A step: the scheduler plans (every decoding request's next token, then prompt chunks under the token budget,
preempting when pages run out), the runner launches the plan, the output processor turns the previous
step's tokens into text and deltas while it runs, the runner collects the results (one host copy a call),
the scheduler advances the requests, and a request that has picked a stop token or max_tokens tokens (or
whose text reached a stop string) is finished and its pages go back.

    engine = Engine(model, tokenizer, get_format("residual"), eos_ids=(0,), max_len=256, memory_bytes=2**30)
    engine.warm_up()                                   # compiles every program; seconds per program
    outs = engine.generate(["62217+89000="], SamplingParams(max_tokens=8))   # texts, tokens, logprobs

Memory follows the tokens: a request holds the pages its tokens fill (`page_size` tokens each, every loop and
layer), so the cache holds as many requests as their lengths allow, not a fixed number of `max_len` slots;
full prompt pages are shared between requests with the same prefix (the same tokens from the first on, the
same format and calibration, and for Huginn's random initial state the same seed), so a prompt that starts
with cached pages computes only the rest. kivi, whose windows of full-precision tokens are per row, takes
whole rows as pages (`max_len` tokens each) and shares nothing.

Exactness: a request's greedy tokens are the `Sampler`'s for its prompt alone with the engine's prompt
chunk (`SamplingConfig(prefill_chunk=chunk)`), whatever joins, leaves, is preempted or hits the prefix
cache: its prompt runs in the same chunks (each reading the ones before from the cache, as the Sampler's
chunked prefill does), its keys follow the Sampler's chain, and a preempted request replays its output one
token a step. Rows differ from the Sampler's batch in nothing a row can see.

The engine is single-threaded: `add_request`, `cancel` and `step` are called from one thread
(`rq_jax.serve.api` runs it on its own).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import time
from typing import Callable, Sequence

import jax
import numpy as np

from rq_jax import setup
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.dense import Dense
from rq_jax.serve import sizing
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.model_runner import ModelRunner, RowSpec
from rq_jax.serve.output import Completion, Delta, OutputProcessor, Request, TokenLogprob, completion
from rq_jax.serve.params import ParamError, SamplingParams, check_request
from rq_jax.serve.scheduler import Scheduler
from rq_jax.serve.text import TextStream


def calibration_key(fmt: CacheFormat, plain_fmt: CacheFormat, calib: CacheCalib | None) -> str:
    """What the prefix index keys pages by besides their tokens: the formats and a digest of the calibration
    (a page's codes depend on both)."""
    h = hashlib.sha256(repr((fmt, plain_fmt)).encode())
    for leaf in jax.tree_util.tree_leaves(calib):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


class Engine:
    """Requests over a paged cache of `fmt` (default dense bf16): `memory_bytes` of pages of `page_size`
    tokens (default `sizing.default_page_size()`), or room for `num_slots` requests of `max_len` tokens; at most
    `max_rows` requests decoding at once (default `num_slots`, else `sizing.DEFAULT_MAX_ROWS`); prompts in
    chunks of `chunk` tokens, a step's tokens at most `token_budget` (default max(chunk,
    `sizing.DEFAULT_TOKEN_BUDGET`)); `prefix_cache` shares full prompt pages (`sizing.size_pool`).
    `eos_ids` end every request. `calib`, `plain_fmt`, `mesh` and `model_kwargs` (e.g. `num_loops`,
    Huginn's `init_scale`) are the Sampler's. `metrics` (a `ServeMetrics`) is kept up to date when given.
    """

    def __init__(self, model, tokenizer, fmt: CacheFormat | None = None, *, eos_ids: Sequence[int] = (),
                 max_len: int = 256, num_slots: int | None = None, memory_bytes: int | None = None,
                 plain_fmt: CacheFormat | None = None, calib: CacheCalib | None = None, mesh=None,
                 chunk: int = 256, token_budget: int | None = None, page_size: int | None = None,
                 max_rows: int | None = None, prefix_cache: bool = True, metrics: ServeMetrics | None = None,
                 **model_kwargs):
        config = model.config
        self.config, self.tokenizer, self.mesh, self.metrics = config, tokenizer, mesh, metrics
        self.fmt = fmt or Dense()
        self.plain_fmt = plain_fmt or self.fmt
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.num_loops = setup.num_loops(config, model_kwargs)
        #: Huginn's random initial state is drawn from each request's seed: its K/V depend on the seed too.
        self.seeded_state = config.family == "huginn" and model_kwargs.get("init_scale", 1.0) != 0
        model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None and k != "num_steps"}
        model_kwargs["num_loops"] = self.num_loops
        if not 1 <= max_len <= config.max_position_embeddings:
            raise ValueError(f"max_len must lie in [1, {config.max_position_embeddings}], got {max_len}")
        self.max_len = max_len
        size = sizing.size_pool(model, self.fmt, self.plain_fmt, max_len=max_len, num_loops=self.num_loops,
                                num_slots=num_slots, memory_bytes=memory_bytes, chunk=chunk,
                                token_budget=token_budget, page_size=page_size, max_rows=max_rows,
                                prefix_cache=prefix_cache)
        self.page_size, self.chunk, self.token_budget = size.page_size, size.chunk, size.token_budget
        self.num_pages, self.page_bytes, self.max_rows = size.num_pages, size.page_bytes, size.max_rows
        self.dense_token_bytes = sizing.dense_token_bytes(config, self.num_loops)
        self.runner = ModelRunner(model, self.fmt, pages=self.num_pages, page_size=self.page_size, max_len=max_len,
                                  max_rows=self.max_rows, chunk=self.chunk, token_budget=self.token_budget,
                                  plain_fmt=self.plain_fmt, calib=calib, mesh=mesh, timer=self._ran, **model_kwargs)
        key = calibration_key(self.fmt, self.plain_fmt, self.runner.calib) if size.prefix_cache else None
        self.scheduler = Scheduler(self.num_pages, self.page_size, self.chunk, self.token_budget, max_len,
                                   cache_key=key, max_running=self.max_rows)
        self.output = OutputProcessor(metrics)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}  # by the scheduler's id
        self._finished: list[Request] = []
        self._unsent: list[Request] = []  # tokens recorded by the last step, text not made yet (`_emit`)
        self.ready = False
        self._update_gauges()

    # ---- compiling ---------------------------------------------------------------------------------

    def warm_up(self, echo: bool = False, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """Compile every program (`ModelRunner.programs`: each decode size, each prompt width and row count,
        with `echo` the prompt log-probabilities' programs) by running it on padding rows; returns wall
        seconds per program. Returns early, not ready, once `stop()` is true (asked between programs: a
        compile cannot be interrupted)."""
        seconds = {}
        for name, run in self.runner.programs(echo):
            if stop is not None and stop():
                return seconds
            start = time.perf_counter()
            run()
            seconds[name] = time.perf_counter() - start
        self.ready = True
        return seconds

    # ---- requests ------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ParamError when this engine cannot serve a request (`params.check_request`)."""
        check_request(prompt, params, self.config.vocab_size, self.max_len)

    def add_request(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                    sink: Callable[[Delta], None] | None = None, arrival: float | None = None) -> str:
        """Queue a request (checked by `check`); `sink` receives its `Delta`s. Returns its id."""
        self.check(prompt, params)
        seq = next(self._ids)
        request_id = request_id or f"req-{seq}"
        stops = (frozenset() if params.ignore_eos else self.eos_ids) | {int(t) for t in params.stop_token_ids}
        request = Request(request_id, seq, [int(t) for t in prompt], params, sink, stops,
                          TextStream(self.tokenizer, params.stop), time.perf_counter() if arrival is None else arrival)
        if params.prompt_logprobs:
            request.prompt_logprobs = [None]
        self._requests[seq] = request
        self.scheduler.add(seq, request.prompt, share=not params.prompt_logprobs,  # echo: every position runs
                           salt=f"/seed={params.seed}" if self.seeded_state else "")
        self._update_gauges()
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Finish a request as cancelled and free its pages now; False when the engine does not hold it."""
        request = next((r for r in self._requests.values() if r.id == request_id), None)
        if request is None:
            return False
        self._finish(request, "cancelled")
        self._update_gauges()
        return True

    def held(self) -> list[str]:
        """Ids of every request the engine holds (waiting or running)."""
        return [r.id for r in self._requests.values()]

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One iteration: the scheduler plans and the model runner launches the plan; while it runs, the output
        processor turns the previous step's tokens into text and deltas (a stop string found there ends its
        request, whose row in this step is dropped); then this step's tokens are recorded (a stop token or
        max_tokens ends a request at once). Returns the requests that finished."""
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.forget(seq)
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        if plan:
            rows = {c.seq: self._row(c.seq) for c in plan.prefill + plan.decode}
            calls = self.runner.launch(plan, rows)
            self._emit()
            results, lost = self.runner.collect(calls, rows)
            self._echo(plan, results)
            new = self.scheduler.update(plan, {seq: r.token for seq, r in results.items()})
            if self.metrics is not None:
                self.metrics.out_of_range.inc(lost)
                self.metrics.prompt_tokens.inc(sum(len(c.tokens) for c in plan.prefill))
            for seq, token in new.items():
                request, r = self._requests[seq], results[seq]
                reason = self.output.token(request, token, r.logprob, zip(r.top_ids.tolist(), r.top_logprobs.tolist()))
                if reason is not None:
                    self._finish(request, reason)
                else:
                    self._unsent.append(request)
        if not plan or not self.scheduler.has_work():
            self._emit()
        self._update_gauges()
        finished, self._finished = self._finished, []
        return finished

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Completion]:
        """The offline API: run prompts (text or token ids) to completion, continuously batched;
        one `Completion` per prompt, in order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        done: dict[str, Completion] = {}
        collected: dict[str, list[Delta]] = collections.defaultdict(list)
        ids = []
        for prompt, p in zip(prompts, params):
            tokens = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
            ids.append(self.add_request(tokens, p, sink=lambda d: collected[d.request_id].append(d)))
        while self.has_work():
            for request in self.step():
                if request.id in collected:  # not a request added by someone else (e.g. cancelled earlier)
                    done[request.id] = completion(request, collected.pop(request.id))
        return [done[i] for i in ids]

    # ---- internals -----------------------------------------------------------------------------

    def _row(self, seq: int) -> RowSpec:
        request = self._requests[seq]
        p = request.params
        return RowSpec(p.seed, p.temperature, p.top_k, p.top_p, request.prompt, p.prompt_logprobs)

    def _echo(self, plan, results) -> None:
        """The prompt log-probabilities of the echo rows' chunks (the first time each position runs)."""
        for chunk in plan.prefill:
            result, request = results[chunk.seq], self._requests[chunk.seq]
            if result.prompt is None or len(request.prompt_logprobs) > chunk.start + 1:
                continue  # a preempted request's prompt running again
            logprob, ids, values = result.prompt
            want = request.params.logprobs
            count = min(chunk.start + len(chunk.tokens), len(request.prompt) - 1) - chunk.start
            request.prompt_logprobs += [
                TokenLogprob(request.prompt[chunk.start + t + 1], float(logprob[t]),
                             tuple(zip(ids[t, :want].tolist(), values[t, :want].tolist())))
                for t in range(count)]

    def _emit(self) -> None:
        """The text and deltas of the tokens the last step recorded (`OutputProcessor.emit`)."""
        unsent, self._unsent = self._unsent, []
        for request in unsent:
            if request.finish_reason is None:  # not cancelled since
                reason = self.output.emit(request)
                if reason is not None:
                    self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        self._requests.pop(request.seq, None)
        self.scheduler.finish(request.seq)
        self.runner.forget(request.seq)
        self.output.finish(request, reason)
        self._finished.append(request)

    def _ran(self, phase: str, seconds: float, rows: int) -> None:
        """With metrics, after the warm-up: count a call of `phase` of `rows` compiled rows that ran `seconds`."""
        if self.metrics is not None and self.ready:
            self.metrics.ran(phase, seconds)
            if phase == "decode":
                self.metrics.decode_rows.inc(rows)

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.pool(self.scheduler, max_rows=self.max_rows, pages=self.num_pages, page_size=self.page_size,
                              page_bytes=self.page_bytes, dense_token_bytes=self.dense_token_bytes)


__all__ = ["Completion", "Delta", "Engine", "ParamError", "SamplingParams", "TokenLogprob"]
