"""The serving engine's model runner: the compiled programs over a step plan. It owns the model's parameters,
the calibration and the paged cache (a pool of pages, held as bits and donated to every call, so that each
step writes it in place), and each request's PRNG chain; it knows nothing of text or scheduling.

A plan's rows run in a few calls: the decode rows (one token each) in one call over the fewest rows of
`decode_rows` (1, 2, 3, 4, 6, 8, 12, ... `max_rows`: a call's cost grows with its rows) that hold them, the
prompt chunks in calls over `token_buckets` (16, 32, ... `chunk` tokens) × `prefill_rows` (1, 2, 4, ... as the
token budget allows; each chunk padded to its call's width, chunks of far apart widths in calls of their own:
`sizing.prefill_groups`), and a prompt whose log-probabilities are asked for (`echo`) alone in a call of its own.
Padding rows feed nothing and store nothing.

A step is launched, then collected: `launch` dispatches its calls and starts the host copy of each call's
results (packed into one uint32 array: `pack`), so the engine does the host work of the previous step (text,
stops, deltas) while they run; `collect` waits for them and unpacks.

    runner = ModelRunner(model, fmt, pages=1024, page_size=16, max_len=256, max_rows=64, chunk=256, ...)
    calls = runner.launch(plan, requests)
    results, lost = runner.collect(calls, requests)   # {request: (token, logprob, top ids, top logprobs)}
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rq_jax import setup, sharding
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv import init_paged_cache
from rq_jax.serve import programs
from rq_jax.serve.scheduler import Chunk, StepPlan
from rq_jax.serve.sizing import geometric, holding, prefill_groups, row_counts


class RowSpec(NamedTuple):
    """What the runner needs of a row's request: its seed, sampling parameters, prompt (for the chunking
    of its PRNG keys and its prompt log-probabilities) and whether it asked for those."""

    seed: int
    temperature: float
    top_k: int
    top_p: float
    prompt: Sequence[int]
    echo: bool


class RowResult(NamedTuple):
    """A row's pick: the token, its log-probability, the top ids and log-probabilities [n], and for an echo
    row the prompt's per-position log-probabilities of its chunk (logprob [n], ids [n, k], values [n, k])."""

    token: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class Launched(NamedTuple):
    """A call in flight: its rows (`chunks`, then padding up to `rows`), its kind ("decode", "prefill" or
    "echo"), its outputs (device arrays whose host copies have started) and when it was dispatched."""

    chunks: list[Chunk]
    rows: int
    kind: str
    out: tuple
    began: float


class ModelRunner:
    """The compiled programs over a pool of `pages` pages of `page_size` tokens of `fmt` (`plain_fmt` for
    Huginn's prelude and coda), rows of up to `max_len` tokens, at most `max_rows` of them decoding at once
    and prompt chunks of at most `chunk` tokens, `token_budget` tokens a step. `calib`, `mesh` and
    `model_kwargs` (e.g. `num_loops`) are the Sampler's; on a mesh the pool's kv heads are split over
    `model` and the rows over `data` (`sharding.cache_specs`). `timer(phase, seconds, rows)` is called for
    each call collected, with the seconds it ran (from its dispatch, or the previous call's end when later) and
    its compiled rows (the engine's metrics)."""

    def __init__(self, model, fmt: CacheFormat, *, pages: int, page_size: int, max_len: int, max_rows: int,
                 chunk: int, token_budget: int, plain_fmt: CacheFormat | None = None, calib: CacheCalib | None = None,
                 mesh=None, timer: Callable[[str, float, object], None] | None = None, **model_kwargs):
        config = model.config
        plain_fmt = plain_fmt or fmt
        self.page_size, self.max_len, self.chunk = page_size, max_len, chunk
        self.pages_per_row = -(-max_len // page_size)
        self.timer = timer or (lambda phase, seconds, rows: None)
        self.decode_rows = row_counts(max_rows)
        self.token_buckets = geometric(min(16, chunk), chunk, 2)
        self.prefill_rows = {t: geometric(1, max(1, min(max_rows, token_budget // t)), 2) for t in self.token_buckets}
        self._graphdef, params, num_loops, self.calib, _ = setup.prepare(
            model, fmt, plain_fmt, calib=calib, mesh=mesh, **model_kwargs)
        if self.calib is None:
            raise ValueError(f"the {fmt.describe()} cache needs a calibration fitted on data (scripts/calibrate.py)")

        def pool():  # built by a compiled program: no two leaves share a buffer (the calls donate it)
            return init_paged_cache(config, 1, pages, page_size, self.pages_per_row, fmt, num_loops=num_loops,
                                    plain_fmt=plain_fmt).held()

        self.template = jax.eval_shape(pool)  # the pool's cache, abstract
        shardings = None if mesh is None else sharding.named(mesh, _state(sharding.cache_specs(self.template, mesh)))
        # The program takes the parameters, calibration and pool as lists of leaves, and returns the pool so.
        self._call = step_program(self._graphdef, self.template, params, self.calib, mesh, **model_kwargs)
        self._fixed = (jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(self.calib))
        self.state = jax.tree_util.tree_leaves(jax.jit(lambda: _state(pool()), out_shardings=shardings)())
        self._rng: dict[int, np.ndarray] = {}  # per request: its chain key (raw data) after its last call

    # ---- a step ----------------------------------------------------------------------------------------

    def launch(self, plan: StepPlan, rows: dict[int, RowSpec]) -> list[Launched]:
        """Dispatch the calls of `plan` (`rows`: each request's `RowSpec`) and start their results' host
        copies; returns them for `collect`."""
        echo = [c for c in plan.prefill if rows[c.seq].echo]
        prefill = [c for c in plan.prefill if not rows[c.seq].echo]
        calls = []
        groups = prefill_groups([len(c.tokens) for c in prefill], self.token_buckets, self.prefill_rows)
        for chunks, kind in ((plan.decode, "decode"), *(([prefill[i] for i in g], "prefill") for g in groups),
                             *(([c], "echo") for c in echo)):
            if chunks:
                calls.append(self._launch(list(chunks), rows, kind))
        return calls

    def _launch(self, chunks: list[Chunk], rows: dict[int, RowSpec], kind: str) -> Launched:
        prefill = kind != "decode"
        width = 1 if not prefill else holding(self.token_buckets, max(len(c.tokens) for c in chunks))
        sizes = self.decode_rows if not prefill else self.prefill_rows[width]
        count = holding(sizes, len(chunks))  # prompt chunks come in calls that fit (prefill_groups)
        call = padding(count, width, self.pages_per_row)
        tokens, num_new, lengths, table, (temperature, top_k, top_p), (seed, chunk_index, rng), targets = call
        for i, c in enumerate(chunks):
            spec = rows[c.seq]
            n = len(c.tokens)
            tokens[i, :n], num_new[i], lengths[i] = c.tokens, n, c.start
            table[i, : len(c.table)] = c.table
            temperature[i], top_k[i], top_p[i], seed[i] = spec.temperature, spec.top_k, spec.top_p, spec.seed
            if prefill:
                chunk_index[i] = -1 if len(spec.prompt) <= self.chunk else c.start // self.chunk
                following = spec.prompt[c.start + 1 : c.start + n + 1]
                targets[i, : len(following)] = following
            else:
                rng[i] = self._rng[c.seq]
        began = time.perf_counter()
        self.state, out = self._call(*self._fixed, self.state, *call, prefill=prefill, echo=kind == "echo")
        for leaf in jax.tree_util.tree_leaves(out):
            leaf.copy_to_host_async()
        return Launched(chunks, count, kind, out, began)

    def collect(self, calls: list[Launched], rows: dict[int, RowSpec]) -> tuple[dict[int, RowResult], int]:
        """Wait for `calls` (`launch`'s) and return each row's result by request and the values the cache could
        not store (summed over rows). A decode row of a request forgotten since its launch (finished by the
        host work that ran meanwhile) keeps no chain key."""
        results, lost, ready = {}, 0, 0.0
        for call in calls:
            packed, prompt = sharding.to_host(call.out)
            done = time.perf_counter()
            self.timer("decode" if call.kind == "decode" else "prefill", done - max(call.began, ready), call.rows)
            ready = done
            picked, next_rng, out_of_range = unpack(packed)
            for i, c in enumerate(call.chunks):
                spec = rows[c.seq]
                if call.kind == "decode" and c.seq not in self._rng:
                    continue
                if call.kind == "decode" or c.start + len(c.tokens) >= len(spec.prompt):  # the chain goes on
                    self._rng[c.seq] = next_rng[i]
                echoed = None if prompt is None else tuple(x[i, : len(c.tokens)] for x in prompt)
                results[c.seq] = RowResult(int(picked.tokens[i]), float(picked.logprob[i]), picked.top_ids[i],
                                           picked.top_logprobs[i], echoed)
            lost += int(np.sum(out_of_range[: len(call.chunks)]))
        return results, lost

    def forget(self, seq: int) -> None:
        """Drop a request's chain key (finished, or preempted: its prompt starts the chain again)."""
        self._rng.pop(seq, None)

    # ---- compiling -----------------------------------------------------------------------------------

    def programs(self, echo: bool = False) -> list[tuple[str, Callable[[], None]]]:
        """Every program a step can call, as (name, a call compiling it by running it on padding rows that
        store nothing): each decode size, each prompt width × row count, and with `echo` one echo program per
        width."""
        out = [(f"decode {r}", functools.partial(self._warm, r, 1, False, False)) for r in self.decode_rows]
        for t in self.token_buckets:
            out += [(f"prefill {t} x{r}", functools.partial(self._warm, r, t, True, False))
                    for r in self.prefill_rows[t]]
            if echo:
                out.append((f"prefill {t} echo", functools.partial(self._warm, 1, t, True, True)))
        return out

    def _warm(self, count: int, width: int, prefill: bool, echo: bool) -> None:
        self.state, out = self._call(*self._fixed, self.state, *padding(count, width, self.pages_per_row),
                                     prefill=prefill, echo=echo)
        jax.block_until_ready(out)


def pack(picked: programs.Picked, next_rng: jax.Array, lost: jax.Array) -> jax.Array:
    """A call's results in one array, for one host copy: per row, uint32 bits of its token, log-probability,
    top ids [n], top log-probabilities [n], next chain key [2] and values lost: [R, 2n + 5]."""
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint32)
    return jnp.concatenate([bits(picked.tokens)[:, None], bits(picked.logprob)[:, None], bits(picked.top_ids),
                            bits(picked.top_logprobs), next_rng, bits(lost)[:, None]], axis=1)


def unpack(packed: np.ndarray) -> tuple[programs.Picked, np.ndarray, np.ndarray]:
    """`pack`'s array on the host [R, 2n + 5] as (picks, next chain keys [R, 2], values lost [R]): numpy views."""
    n = programs.TOP_LOGPROBS
    picked = programs.Picked(packed[:, 0].view(np.int32), packed[:, 1].view(np.float32),
                             packed[:, 2 : 2 + n].view(np.int32), packed[:, 2 + n : 2 + 2 * n].view(np.float32))
    return picked, packed[:, 2 + 2 * n : 4 + 2 * n], packed[:, 4 + 2 * n].view(np.int32)


def step_program(graphdef, template, params, calib, mesh=None, *, jit=setup.jit, **model_kwargs):
    """The runner's one program, jitted by `jit` (`setup.jit`: to run on this host; `jax.jit` to lower it for another
    platform, as `bench_decode.py --tpu` does), the pool's state donated: `call(params, calib, state, *padding(...),
    prefill=, echo=)` runs a call's rows (`programs.run_rows`) over the pool whose cache `template` (abstract,
    lengths and table aside) holds `state` = (looped, plain), and returns (the new state, (the picks, next chain
    keys and values lost per row in one array: `pack`, prompt log-probabilities or None)). The parameters,
    calibration and state come as lists of their leaves (`jax.tree_util.tree_leaves` of trees shaped as `params`,
    `calib` and the template's, concrete or abstract), and the new state goes back as one: a dispatch then neither
    flattens nor rebuilds the trees (Ouro-small's decode call at one row dispatched in 0.27 against 0.34 ms dense,
    0.39 against 0.55 ms residual). `model_kwargs` are the model's (`num_loops`); on `mesh` the state stays split as
    `sharding.cache_specs` says."""
    params_def, calib_def, state_def = (jax.tree_util.tree_structure(x) for x in (params, calib, _state(template)))

    def call(params, calib, state, tokens, num_new, lengths, table, params_rows, keys, targets, *,
             prefill: bool, echo: bool):
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(params_def, params))
        looped, plain = jax.tree_util.tree_unflatten(state_def, state)
        rows = tokens.shape[0]
        cache = template.replace(looped=looped, plain=plain, lengths=lengths, block_table=table,
                                 overflow=jnp.zeros((rows,), bool), out_of_range=jnp.zeros((rows,), jnp.int32))
        cache, picked, next_rng, prompt = programs.run_rows(
            model, jax.tree_util.tree_unflatten(calib_def, calib), cache, tokens, num_new, params_rows, keys,
            prefill, targets if echo else None, **model_kwargs)
        state = _state(cache)
        if mesh is not None:
            state = sharding.constrain(state, _state(sharding.cache_specs(cache, mesh)), mesh)
        return jax.tree_util.tree_leaves(state), (pack(picked, next_rng, cache.out_of_range), prompt)

    return jit(call, donate_argnums=2, static_argnames=("prefill", "echo"))


def padding(count: int, width: int, pages_per_row: int) -> tuple:
    """A call's arguments after the state for `count` padding rows of `width` tokens (no tokens, greedy, a
    one-chunk prompt's keys): tokens [count, width], num_new, lengths [count], block tables [count,
    pages_per_row], `programs.Sampling`, `programs.RowKeys`, targets [count, width] — numpy arrays a step
    fills in for its rows."""
    def ints():  # a fresh array for each field
        return np.zeros(count, np.int32)

    return (np.zeros((count, width), np.int32), ints(), ints(), np.zeros((count, pages_per_row), np.int32),
            programs.Sampling(np.zeros(count, np.float32), ints(), np.ones(count, np.float32)),
            programs.RowKeys(ints(), np.full(count, -1, np.int32), np.zeros((count, 2), np.uint32)),
            np.zeros((count, width), np.int32))


def _state(cache):
    """The pool's leaves a call donates and returns: (looped, plain)."""
    return cache.looped, cache.plain
