"""A continuous-batching engine: decode slots sharing one batched `KVCache` of any format.

A request waits for a free slot; its prompt is prefilled into a staging row (lengths bucketed to
powers of two so compiles stay few; a prompt longer than `chunk` runs chunk by chunk, interleaved with
decode steps so running streams keep flowing), written once into the served format and inserted into
the slot. Waiting requests whose prompts fit one chunk enter together: up to `prefill_rows` of them are
prefilled (`prefill_group` rows at a time, in a loop over the groups that hold requests), encoded and
scattered into their slots by one program. One compiled decode step advances
every occupied slot (over the fewest leading slots that hold them, from a few compiled sizes), each
with its own sampling parameters and PRNG key; a finished or cancelled request frees its slot at once
and the next waiting request takes it.

    engine = Engine(model, tokenizer, get_format("residual"), eos_ids=(0,), max_len=256, memory_bytes=2**30)
    engine.warm_up()                                   # compiles every program; seconds per program
    outs = engine.generate(["62217+89000="], SamplingParams(max_tokens=8))   # texts, tokens, logprobs

Exactness: a request's greedy tokens are the `Sampler`'s for its prompt alone, whatever else runs
beside it. Its prefill is the Sampler's program with a dense store for the prompt (the prompt's tokens
attend each other at full precision in both), its stored K/V are one `write` of the whole prompt in
both, and its keys follow the Sampler's chain. The slots differ from the Sampler's batch in nothing a
row can see: padding, batch-mates and cache length are masked. Prompts longer than `chunk` are the
exception for Huginn's random initial state, whose noise is drawn per call position: their later
chunks draw theirs from `fold_in(model_rng, chunk)` instead.

The engine is single-threaded: `add_request`, `cancel` and `step` are called from one thread
(`rq_jax.serve.api` runs it on its own).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rq_jax import sharding
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.dense import Dense
from rq_jax.cache.calib import CacheCalib, default_calib
from rq_jax.cache.kv import cache_bytes, init_cache
from rq_jax.serve import programs
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.text import TextStream

FINISH_REASONS = ("stop", "length", "cancelled")


class ParamError(ValueError):
    """A request parameter that cannot be served; `param` names it (the API's 400 `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is generated. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    `stop` strings end the text before them; `stop_token_ids` add to the engine's eos ids (the token
    is counted, its text is not part of the output), which `ignore_eos` leaves out. `seed` seeds the
    request's PRNG chain (the Sampler's `seed`: sampling, and Huginn's random initial state).
    `logprobs` alternatives (0 to `TOP_LOGPROBS`) are reported per token beside the chosen token's own
    log-probability; `prompt_logprobs` adds the prompt's (the API's `echo`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: bool = False

    def __post_init__(self):
        def need(ok: bool, param: str, what: str):
            if not ok:
                raise ParamError(param, f"{param} must be {what}, got {getattr(self, param)!r}")

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer ≥ 1")
        need(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature", "a finite number ≥ 0")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer ≥ 0 (0: off)")
        need(_is_int(self.seed) and 0 <= self.seed < 2**31, "seed", "an integer in [0, 2^31)")
        need(_is_int(self.logprobs) and 0 <= self.logprobs <= programs.TOP_LOGPROBS, "logprobs",
             f"an integer in [0, {programs.TOP_LOGPROBS}]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "integers")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the `logprobs` most likely alternatives (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request produced since its last delta: text, token ids, their log-probabilities; the
    finish reason on the last one (stop, length or cancelled); the prompt's log-probabilities (None for
    its first token) on the first one when asked for."""

    request_id: str
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its text, generated token ids (a stop token included), their log-probabilities,
    the finish reason, the prompt's ids and (when asked for) log-probabilities."""

    request_id: str
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str
    prompt: tuple[int, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None


@dataclasses.dataclass(eq=False)
class Request:
    """A request's state while the engine holds it."""

    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Delta], None] | None
    stops: frozenset[int]
    stream: TextStream
    arrival: float
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    last_time: float | None = None
    sent_tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Prefill:
    """A prompt on its way into a slot: its chunks, staging row and keys."""

    request: Request
    slot: int
    keys: jax.Array  # [3]: rng, model_rng, pick_rng
    sampling: programs.Slots  # one row
    stage: object
    chunks: list[tuple[int, int]]  # (start, end) of the prompt
    done: int = 0
    picked: programs.Picked | None = None


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2·lo, ... below hi, then hi: the prefill buckets."""
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def quarters(num_slots: int) -> tuple[int, ...]:
    """num_slots, then a quarter of the last (rounded up) while that is at least 8, ascending: the decode
    step sizes (a step over R slots wastes at most 4x on the slots it runs idle)."""
    out = [num_slots]
    while -(-out[-1] // 4) >= 8:
        out.append(-(-out[-1] // 4))
    return tuple(reversed(out))


def compute_dtype(model) -> str:
    """The dtype a model computes in (its embedding's): the dtype of the K/V it produces."""
    return next(jnp.dtype(m.dtype).name for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Embed))


class Engine:
    """Decode slots over one batched cache of `fmt` (default dense bf16), fed by a waiting queue.

    `num_slots`, or as many slots as `memory_bytes` of cache hold (`cache_bytes` of one row each, rounded
    down to a multiple of the mesh's `data` size), each `max_len` tokens long (prompt + max_tokens − 1 must
    fit). Prompts run in chunks of at most `chunk` tokens, padded to a bucket (`powers_of_two(16,
    chunk)`); each `step` spends up to `prefill_budget` bucket tokens (default max(chunk, 512)) on
    prefill chunks, then runs one decode step over the first R slots, R the smallest of
    `decode_buckets` (`quarters(num_slots)`; all slots on a mesh split over `data`) that holds
    every running request: a request takes the lowest free slot, so few requests cost a small step.
    Up to `prefill_rows` waiting requests whose prompts fit one chunk (no prompt
    log-probabilities) enter together through one batched prefill (`programs.prefill_batch`, which runs
    `prefill_group` rows at a time over only the groups that hold requests; off on a mesh and for 1).
    `eos_ids` end every request. `calib`, `plain_fmt`, `mesh` and `model_kwargs` (e.g. `num_loops`,
    Huginn's `init_scale`) are the Sampler's. `metrics` (a `ServeMetrics`) is kept up to date when given.
    """

    def __init__(self, model, tokenizer, fmt: CacheFormat | None = None, *, eos_ids: Sequence[int] = (),
                 max_len: int = 256, num_slots: int | None = None, memory_bytes: int | None = None,
                 plain_fmt: CacheFormat | None = None, calib: CacheCalib | None = None, mesh=None,
                 chunk: int = 256, prefill_budget: int | None = None, prefill_rows: int = 32,
                 prefill_group: int = 4, metrics: ServeMetrics | None = None, **model_kwargs):
        config = model.config
        self.config, self.tokenizer, self.mesh, self.metrics = config, tokenizer, mesh, metrics
        self.fmt = fmt or Dense()
        self.plain_fmt = plain_fmt or self.fmt
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.num_loops = model_kwargs.get("num_loops") or config.num_loops
        self.model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
        self.model_kwargs["num_loops"] = self.num_loops
        if not 1 <= max_len <= config.max_position_embeddings:
            raise ValueError(f"max_len must lie in [1, {config.max_position_embeddings}], got {max_len}")
        self.max_len = max_len
        self.chunk = min(chunk, max_len)
        self.buckets = powers_of_two(min(16, self.chunk), self.chunk)
        self.admit_buckets = powers_of_two(min(16, self.chunk), max_len)  # staged positions an admit encodes
        self.prefill_budget = prefill_budget or max(self.chunk, 512)
        row = cache_bytes(config, self.fmt, max_len, num_loops=self.num_loops, plain_fmt=self.plain_fmt)
        self.slot_bytes, self.dense_slot_bytes = row.total, row.dense
        data = sharding.axis_size(mesh, sharding.DATA)
        if num_slots is None:
            if memory_bytes is None:
                raise ValueError("give num_slots or memory_bytes")
            num_slots = memory_bytes // self.slot_bytes // data * data
            if num_slots < 1:
                per_shard = f", {data} per data shard" if data > 1 else ""
                raise ValueError(f"{memory_bytes:,} bytes of cache hold no slot of {max_len} tokens "
                                 f"({self.slot_bytes:,} bytes each{per_shard})")
        if num_slots < 1:
            raise ValueError(f"num_slots must be ≥ 1, got {num_slots}")
        if prefill_rows < 1:
            raise ValueError(f"prefill_rows must be ≥ 1, got {prefill_rows}")
        if prefill_group < 1:
            raise ValueError(f"prefill_group must be ≥ 1, got {prefill_group}")
        self.num_slots = num_slots
        # A batch of one is the single-request path; on a mesh the staging rows would need sharding too.
        rows = min(prefill_rows, num_slots) if mesh is None else 1
        self.prefill_group = min(prefill_group, rows)
        self.prefill_rows = -(-rows // self.prefill_group) * self.prefill_group  # whole groups
        # Slicing a data-sharded batch would move rows between devices: sharded, every step runs all slots.
        self.decode_buckets = quarters(num_slots) if data == 1 else (num_slots,)

        self._graphdef, params = nnx.split(model)
        self.params = sharding.shard_state(params, config, mesh)
        stage_fmt = Dense(compute_dtype(model))
        self._stage = sharding.init_sharded_cache(config, 1, max_len, stage_fmt, mesh, num_loops=self.num_loops)
        self._batch_stage = init_cache(config, self.prefill_group, max_len, stage_fmt, num_loops=self.num_loops)
        self._batch_rng = jax.random.split(jax.random.key(0), self.prefill_rows)  # unused: keys come from seeds
        # Built by a compiled program (also without a mesh), so that no two leaves share a buffer: the
        # decode step and the admit donate the cache, held as bits so that they write it in place.
        self.cache = jax.jit(lambda: sharding.init_sharded_cache(config, num_slots, max_len, self.fmt, mesh,
                                                                 num_loops=self.num_loops,
                                                                 plain_fmt=self.plain_fmt).as_bits())()
        if calib is None:
            calib = default_calib(jax.eval_shape(lambda: init_cache(config, 1, 1, self.fmt, num_loops=self.num_loops,
                                                                    plain_fmt=self.plain_fmt)))
        self.calib = sharding.shard_calib(calib, mesh, self.fmt, self.plain_fmt)
        self.slots = self._put(jax.jit(programs.empty_slots, static_argnums=0)(num_slots))

        self._prefill = {echo: jax.jit(functools.partial(self._prefill_fn, echo)) for echo in (False, True)}
        self._admit = jax.jit(self._admit_fn, donate_argnums=(0, 1), static_argnames="length")  # per admit bucket
        self._prefill_batch = jax.jit(self._prefill_batch_fn, donate_argnums=(1, 2))  # a program per bucket
        self._decode = jax.jit(self._decode_fn, donate_argnums=(2, 3))  # a program per len(active)
        self._keys = jax.jit(programs.request_keys)

        self._ids = itertools.count()
        self._waiting: collections.deque[Request] = collections.deque()
        self._free = list(range(num_slots))  # a heap: a request takes the lowest free slot
        self._running: dict[int, Request] = {}
        self._job: _Prefill | None = None
        self._finished: list[Request] = []
        self.ready = False
        self._update_gauges()

    # ---- compiled programs ---------------------------------------------------------------------

    def _prefill_fn(self, echo, params, tokens, num_new, stage, model_rng, sampling, pick_rng, targets):
        model = nnx.merge(self._graphdef, params)
        stage, picked, prompt = programs.prefill_chunk(model, echo, tokens, num_new, stage, model_rng, sampling,
                                                       pick_rng, targets, **self.model_kwargs)
        return sharding.constrain_cache(stage, self.mesh), picked, prompt

    def _decode_fn(self, params, calib, cache, slots, active):
        model = nnx.merge(self._graphdef, params)
        cache, slots, picked = programs.decode_slots(model, calib, cache, slots, active, **self.model_kwargs)
        return sharding.constrain_cache(cache, self.mesh), slots, picked

    def _admit_fn(self, cache, slots, stage, calib, slot, first, sampling, length):
        row = programs.encode_row(self.config, self.fmt, self.plain_fmt, stage, calib, length)
        cache = sharding.constrain_cache(programs.insert_rows(cache, row, slot), self.mesh)
        return cache, programs.scatter_slots(slots, slot[None], sampling.replace(last=first))

    def _prefill_batch_fn(self, params, cache, slots, calib, stage, tokens, num_new, seeds, sampling, ids, count):
        model = nnx.merge(self._graphdef, params)
        return programs.prefill_batch(model, self.config, self.fmt, self.plain_fmt, calib, cache, slots, stage, tokens,
                                      num_new, seeds, sampling, ids, count, **self.model_kwargs)

    def _put(self, tree):
        return tree if self.mesh is None else sharding.put(tree, sharding.replicated(self.mesh))

    def warm_up(self, echo: bool = False, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """Compile every program (a prefill per bucket — also with prompt log-probabilities when `echo`
        — an admit per admit bucket (the staged positions it encodes), a batched prefill per bucket and a
        decode step per decode bucket) by running it once; returns wall seconds per program. Leaves every
        slot free. Returns early, not ready, once `stop()` is true (asked between programs: a compile
        cannot be interrupted)."""
        seconds = {}

        def stopped() -> bool:
            return stop is not None and stop()

        for echo_ in (False, True) if echo else (False,):
            for bucket in self.buckets:
                if stopped():
                    return seconds
                start = time.perf_counter()
                job = self._begin(Request("warm-up", [0] * bucket, SamplingParams(prompt_logprobs=echo_), None,
                                          frozenset(), TextStream(self.tokenizer), 0.0), 0)
                self._run_chunk(job)
                seconds[f"prefill {bucket}" + (" echo" if echo_ else "")] = time.perf_counter() - start
        if stopped():
            return seconds
        for length in self.admit_buckets:
            if stopped():
                return seconds
            start = time.perf_counter()
            self.cache, self.slots = self._admit(self.cache, self.slots, job.stage, self.calib, np.int32(0),
                                                 job.picked.tokens, job.sampling, length=length)
            jax.block_until_ready(self.cache)
            seconds[f"admit {length}"] = time.perf_counter() - start
        if self.prefill_rows > 1:
            for bucket in self.buckets:
                if stopped():
                    return seconds
                start = time.perf_counter()
                self._run_batch([], bucket)  # every row padding: nothing enters
                jax.block_until_ready(self.cache)
                seconds[f"prefill {bucket} x{self.prefill_rows}"] = time.perf_counter() - start
        for rows in self.decode_buckets:
            if stopped():
                return seconds
            start = time.perf_counter()
            self.cache, self.slots, picked = self._decode(self.params, self.calib, self.cache, self.slots,
                                                          np.zeros(rows, bool))
            jax.block_until_ready(picked)
            seconds[f"decode {rows}"] = time.perf_counter() - start
        self.ready = True
        return seconds

    # ---- requests ------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ParamError when a request cannot be served: an empty prompt, token ids outside the
        vocabulary, or a prompt plus max_tokens that does not fit a slot."""
        vocab = self.config.vocab_size
        if len(prompt) == 0:
            raise ParamError("prompt", "the prompt is empty: it needs at least one token")
        bad = sorted({int(t) for t in prompt if not 0 <= int(t) < vocab})
        if bad:
            raise ParamError("prompt", f"prompt token ids must lie in [0, {vocab}), got {bad[:5]}")
        bad = sorted({int(t) for t in params.stop_token_ids if not 0 <= int(t) < vocab})
        if bad:
            raise ParamError("stop_token_ids", f"stop token ids must lie in [0, {vocab}), got {bad[:5]}")
        need = len(prompt) + params.max_tokens - 1  # the last token is never fed back
        if need > self.max_len:
            raise ParamError("max_tokens", f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} "
                             f"needs {need} cache positions, but a slot holds {self.max_len}")

    def add_request(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                    sink: Callable[[Delta], None] | None = None, arrival: float | None = None) -> str:
        """Queue a request (checked by `check`); `sink` receives its `Delta`s. Returns its id."""
        self.check(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stops = (frozenset() if params.ignore_eos else self.eos_ids) | {int(t) for t in params.stop_token_ids}
        request = Request(request_id, [int(t) for t in prompt], params, sink, stops,
                          TextStream(self.tokenizer, params.stop), time.perf_counter() if arrival is None else arrival)
        self._waiting.append(request)
        self._update_gauges()
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Finish a request as cancelled and free its slot now; False when the engine does not hold it."""
        found = self._cancel(request_id)
        self._update_gauges()
        return found

    def _cancel(self, request_id: str) -> bool:
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
                return True
        if self._job is not None and self._job.request.id == request_id:
            request, self._job = self._job.request, None
            heapq.heappush(self._free, request.slot)
            self._finish(request, "cancelled")
            return True
        for slot, request in self._running.items():
            if request.id == request_id:
                self._release(slot)
                self._finish(request, "cancelled")
                return True
        return False

    def held(self) -> list[str]:
        """Ids of every request the engine holds (waiting, in prefill or running)."""
        job = [self._job.request.id] if self._job is not None else []
        return [r.id for r in self._waiting] + job + [r.id for r in self._running.values()]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot (the one in prefill included)."""
        return len(self._running) + (self._job is not None)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._job is not None)

    def step(self) -> list[Request]:
        """One iteration: prefill chunks (up to `prefill_budget` bucket tokens; a finished prompt enters
        its slot; two or more waiting one-chunk prompts enter together, `_run_batch`), then one decode
        step over every slot. Returns the requests that finished."""
        budget = self.prefill_budget
        while budget > 0:
            if self._job is None:
                if not self._waiting or not self._free:
                    break
                batch = self._batchable()
                if len(batch) > 1:
                    budget -= self._run_batch(batch)
                    continue
                self._job = self._begin(self._waiting.popleft(), heapq.heappop(self._free))
            budget -= self._run_chunk(self._job)
            if self._job.done == len(self._job.chunks):
                job, self._job = self._job, None
                self._enter(job)
        if self._running:
            self._decode_all()
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

    def _batchable(self) -> list[Request]:
        """The leading waiting requests that can enter together: at most `prefill_rows` and the free slots,
        each prompt one chunk long and without prompt log-probabilities."""
        batch = []
        for request in itertools.islice(self._waiting, min(self.prefill_rows, len(self._free))):
            if len(request.prompt) > self.chunk or request.params.prompt_logprobs:
                break
            batch.append(request)
        return batch

    def _run_batch(self, batch: list[Request], bucket: int | None = None) -> int:
        """Prefill the waiting requests `batch` together (`prefill_batch`, padded to `prefill_rows` rows
        and the bucket of the longest prompt) into the lowest free slots, and emit their first tokens;
        returns the bucket tokens it cost (of the groups it ran)."""
        rows = self.prefill_rows
        bucket = bucket or next(b for b in self.buckets if b >= max(len(r.prompt) for r in batch))
        tokens, num_new = np.zeros((rows, bucket), np.int32), np.zeros(rows, np.int32)
        seeds, top_k = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        ids = np.full(rows, self.num_slots, np.int32)  # padding rows scatter nowhere
        for i, request in enumerate(batch):
            self._waiting.popleft()
            request.slot = ids[i] = heapq.heappop(self._free)
            p = request.params
            tokens[i, : len(request.prompt)], num_new[i] = request.prompt, len(request.prompt)
            seeds[i], temperature[i], top_k[i], top_p[i] = p.seed, p.temperature, p.top_k, p.top_p
        sampling = programs.Slots(np.zeros(rows, np.int32), temperature, top_k, top_p, self._batch_rng)
        began = time.perf_counter()
        self.cache, self.slots, picked = self._prefill_batch(self.params, self.cache, self.slots, self.calib,
                                                             self._batch_stage, tokens, num_new, seeds, sampling, ids,
                                                             np.int32(len(batch)))
        self._ran("batch_prefill", began, picked)
        picked = sharding.to_host(picked)
        for i, request in enumerate(batch):
            self._running[request.slot] = request
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(request.prompt))
                self.metrics.batch_prefill_requests.inc()
            self._emit(request, *(x[i] for x in picked))
        return -(-len(batch) // self.prefill_group) * self.prefill_group * bucket

    def _begin(self, request: Request, slot: int) -> _Prefill:
        request.slot = slot
        p = request.params
        keys = self._keys(np.int32(p.seed))
        sampling = self._put(programs.Slots(np.zeros(1, np.int32), np.full(1, p.temperature, np.float32),
                                            np.full(1, p.top_k, np.int32), np.full(1, p.top_p, np.float32), keys[:1]))
        n = len(request.prompt)
        chunks = [(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk)]
        if p.prompt_logprobs:
            request.prompt_logprobs = [None]
        return _Prefill(request, slot, keys, sampling, self._stage, chunks)

    def _run_chunk(self, job: _Prefill) -> int:
        """Prefill the job's next chunk; returns its bucket (the tokens it cost)."""
        start, end = job.chunks[job.done]
        n = end - start
        bucket = next(b for b in self.buckets if b >= n)
        prompt = job.request.prompt
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = prompt[start:end]
        model_rng = job.keys[1] if job.done == 0 else jax.random.fold_in(job.keys[1], job.done)
        echo = job.request.params.prompt_logprobs
        targets = None
        if echo:
            targets = np.zeros((1, bucket), np.int32)
            nxt = prompt[start + 1 : end + 1]
            targets[0, : len(nxt)] = nxt
        began = time.perf_counter()
        job.stage, job.picked, lps = self._prefill[echo](self.params, tokens, np.array([n], np.int32), job.stage,
                                                         model_rng, job.sampling, job.keys[2], targets)
        self._ran("prefill", began, job.picked)
        if echo:
            lp, ids, values = sharding.to_host(lps)
            count = min(end, len(prompt) - 1) - start  # positions whose next token is in the prompt
            want = job.request.params.logprobs
            job.request.prompt_logprobs += [
                TokenLogprob(prompt[start + t + 1], float(lp[0, t]),
                             tuple(zip(ids[0, t, :want].tolist(), values[0, t, :want].tolist())))
                for t in range(count)]
        job.done += 1
        return bucket

    def _enter(self, job: _Prefill) -> None:
        """The prefilled request into its slot, and its first token."""
        request = job.request
        began = time.perf_counter()
        length = next(b for b in self.admit_buckets if b >= len(request.prompt))
        self.cache, self.slots = self._admit(self.cache, self.slots, job.stage, self.calib, np.int32(job.slot),
                                             job.picked.tokens, job.sampling, length=length)
        self._ran("admit", began, self.cache)
        self._running[job.slot] = request
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(request.prompt))
        picked = sharding.to_host(job.picked)
        self._emit(request, *(x[0] for x in picked))

    def _decode_all(self) -> None:
        """One decode step over the first R slots, R the smallest decode bucket holding every running one."""
        rows = next(r for r in self.decode_buckets if r > max(self._running))
        active = np.zeros(rows, bool)
        active[list(self._running)] = True
        began = time.perf_counter()
        self.cache, self.slots, picked = self._decode(self.params, self.calib, self.cache, self.slots, active)
        self._ran("decode", began, picked)
        if self.metrics is not None:
            self.metrics.decode_rows.inc(rows)
        tokens, logprob, top_ids, top_lps = sharding.to_host(picked)
        for slot, request in list(self._running.items()):
            self._emit(request, tokens[slot], logprob[slot], top_ids[slot], top_lps[slot])

    def _ran(self, phase: str, began: float, result) -> None:
        """With metrics, after the warm-up: wait for `result` and count a call of `phase` (prefill, admit,
        decode) since `began`."""
        if self.metrics is not None and self.ready:
            jax.block_until_ready(result)
            self.metrics.ran(phase, time.perf_counter() - began)

    def _emit(self, request: Request, token, logprob, top_ids, top_lps) -> None:
        """Record a request's new token; finish it on a stop token, a stop string or max_tokens."""
        now = time.perf_counter()
        token = int(token)
        want = request.params.logprobs
        request.tokens.append(token)
        request.logprobs.append(TokenLogprob(token, float(logprob),
                                             tuple(zip(top_ids[:want].tolist(), top_lps[:want].tolist()))))
        if self.metrics is not None:
            self.metrics.generated_tokens.inc()
            if request.last_time is None:
                self.metrics.ttft.observe(now - request.arrival)
            else:
                self.metrics.itl.observe(now - request.last_time)
        request.last_time = now
        reason = None
        if token in request.stops or request.stream.add(token):
            reason = "stop"
        elif len(request.tokens) >= request.params.max_tokens:
            reason = "length"
        if reason is None:
            self._send(request)
        else:
            self._release(request.slot)
            self._finish(request, reason)

    def _release(self, slot: int) -> None:
        request = self._running.pop(slot)
        if self.metrics is not None:
            self.metrics.out_of_range.inc(int(sharding.to_host(self.cache.out_of_range)[slot]))
        heapq.heappush(self._free, slot)
        request.slot = None

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self._send(request)
        self._finished.append(request)
        if self.metrics is not None:
            self.metrics.finished(reason)
            if request.last_time is not None:
                self.metrics.e2e.observe(time.perf_counter() - request.arrival)

    def _send(self, request: Request) -> None:
        """Hand the request's sink what is new (everything on its last delta)."""
        final = request.finish_reason is not None
        text = request.stream.pending(final)
        new = slice(request.sent_tokens, len(request.tokens))
        if request.sink is not None and (text or final or new.start < new.stop):
            first = request.sent_tokens == 0 and request.prompt_logprobs is not None
            request.sink(Delta(request.id, text, tuple(request.tokens[new]), tuple(request.logprobs[new]),
                               request.finish_reason, tuple(request.prompt_logprobs) if first else None))
        request.sent_tokens = len(request.tokens)

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        used = self.num_slots - len(self._free)
        m = self.metrics
        m.running.set(self.num_running)
        m.waiting.set(len(self._waiting))
        m.slots_used.set(used)
        m.slots_total.set(self.num_slots)
        m.cache_bytes.set(used * self.slot_bytes)
        m.dense_bytes.set(used * self.dense_slot_bytes)


def completion(request: Request, deltas: Sequence[Delta]) -> Completion:
    """A finished request's `Completion`, from the deltas its sink received."""
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return Completion(request.id, "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.tokens),
                      tuple(lp for d in deltas for lp in d.logprobs), request.finish_reason, tuple(request.prompt),
                      prompt_logprobs)
