"""The serving engine's compiled pieces: pure functions over a batched `KVCache` whose rows are decode slots.

    prefill_chunk   one request's prompt chunk [1, T] into its staging row, a dense cache in the compute
                    dtype (every chunk reads the earlier ones exactly as its own in-flight K/V)
    encode_row      the staged prompt written once into a row of the served format (one `write`, as a
                    single-call prefill writes it)
    insert_rows     a row cache into slot i of the batched cache: every leaf's batch axis
    prefill_batch   up to P requests' one-chunk prompts prefilled G at a time, encoded and scattered into
                    their slots in one program (the waiting queue's fast path: one call instead of 2P)
    decode_slots    one token for every slot of the first R (`rq_jax.sampling.decode_step`, the Sampler's),
                    each with its own sampling parameters and PRNG key

`model` is the merged model and `model_kwargs` its static keywords; the engine jits these with them.
Each slot follows the `Sampler`'s PRNG chain for its request alone — `rng, model_rng, pick_rng =
split(key, 3)` per call — so a request's tokens never depend on its batch-mates.

Shapes: B slots · T chunk tokens · V vocab · n `TOP_LOGPROBS`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from rq_jax import sampling
from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.context import CacheContext
from rq_jax.cache.kv import KVCache, init_cache
from rq_jax.config import ModelConfig

#: Alternatives reported per token (OpenAI's completions allow up to 5).
TOP_LOGPROBS = 5

@struct.dataclass
class Slots:
    """Per-slot decode inputs: each slot's last token and its request's sampling parameters and key."""

    __no_type_check__ = True  # jax rebuilds this pytree with placeholder leaves: the suite's checker skips its fields

    last: Int[Array, "b"]
    temperature: Float[Array, "b"]
    top_k: Int[Array, "b"]
    top_p: Float[Array, "b"]
    rng: jax.Array  # [B] PRNG keys


class Picked(NamedTuple):
    """Chosen tokens [B], their log-probabilities under the model (log-softmax of the raw logits) [B],
    and the n most likely tokens with theirs [B, n]."""

    tokens: Int[Array, "b"]
    logprob: Float[Array, "b"]
    top_ids: Int[Array, "b n"]
    top_logprobs: Float[Array, "b n"]


class PromptLogprobs(NamedTuple):
    """Per chunk position t: log-probability of the prompt's token t + 1 [1, T] and the top n [1, T, n]."""

    logprob: Float[Array, "1 t"]
    top_ids: Int[Array, "1 t n"]
    top_logprobs: Float[Array, "1 t n"]


def empty_slots(num_slots: int) -> Slots:
    """Slots holding nothing (greedy, key 0)."""
    return Slots(jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots,), jnp.float32),
                 jnp.zeros((num_slots,), jnp.int32), jnp.ones((num_slots,), jnp.float32),
                 jax.random.split(jax.random.key(0), num_slots))


def top_logprobs(logits: Float[Array, "... v"]) -> tuple[Float[Array, "... v"], Int[Array, "... n"],
                                                         Float[Array, "... n"]]:
    """Log-softmax of `logits` and its `TOP_LOGPROBS` largest entries (ids, values)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return logp, ids.astype(jnp.int32), values


def choose(logits: Float[Array, "b v"], slots: Slots, keys: jax.Array) -> Picked:
    """Each row's token under its own parameters and pick key [B], with log-probabilities: argmax at
    temperature 0, else a draw from `sampling.restrict_logits` of its row as a batch of one row (the
    Sampler's draw for a one-prompt batch). What no row needs is skipped at run time (`lax.cond`): the
    draws when every row is greedy, the top-k/top-p sorts when no row filters — they cost more than the
    rest of a small model's decode step on a CPU."""
    sampled_rows = slots.temperature > 0
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(logits):
        temperature = jnp.where(sampled_rows, slots.temperature, 1.0)
        filtered = sampled_rows & ((slots.top_k > 0) | (slots.top_p < 1))
        restricted = jax.lax.cond(
            jnp.any(filtered),
            lambda x: sampling.restrict_logits(x, temperature, slots.top_k, slots.top_p),
            lambda x: x.astype(jnp.float32) / temperature[:, None], logits)
        return jax.vmap(lambda key, row: jax.random.categorical(key, row[None], axis=-1)[0])(keys, restricted)

    drawn = jax.lax.cond(jnp.any(sampled_rows), sample, lambda _: greedy, logits)
    tokens = jnp.where(sampled_rows, drawn.astype(jnp.int32), greedy)
    logp, ids, values = top_logprobs(logits)
    return Picked(tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], ids, values)


def request_keys(seed: Int[Array, ""]) -> jax.Array:
    """A request's (rng, model_rng, pick_rng) of its prefill, as the Sampler splits `key(seed)`: [3] keys."""
    return jax.random.split(jax.random.key(seed), 3)


def prefill_chunk(model, echo: bool, tokens: Int[Array, "1 t"], num_new: Int[Array, "1"], stage: KVCache,
                  model_rng: jax.Array, slot: Slots, pick_rng: jax.Array, targets: Int[Array, "1 t"] | None = None,
                  **model_kwargs) -> tuple[KVCache, Picked, PromptLogprobs | None]:
    """Run a prompt chunk (num_new[0] of its T tokens real) into the staging row `stage`; the token
    chosen after its last real token under the one-row sampling `slot` (used after the prompt's last
    chunk) and, with `echo`, the log-probabilities of `targets` (the prompt's next tokens) at every
    position."""
    out = model(tokens, stage, num_new=num_new, rng=model_rng, last_only=not echo, **model_kwargs)
    logits, prompt = out.logits, None
    if echo:
        logp, ids, values = top_logprobs(logits)
        prompt = PromptLogprobs(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], ids, values)
        logits = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return out.cache, choose(logits, slot, pick_rng[None]), prompt


def encode_row(config: ModelConfig, fmt, plain_fmt, stage: KVCache, calib: CacheCalib | None,
               length: int | None = None) -> KVCache:
    """The staged prompts (dense, compute dtype, R rows) as an R-row cache of `fmt` (`plain_fmt` for
    Huginn's prelude/coda): every loop's K/V written in one call, as a single-call prefill writes them.
    Only the first `length` staged positions (static; default all) are encoded: the prompts' bucket, as
    encoding costs what it is given, not what the rows hold."""
    length = stage.max_len if length is None else length
    row = init_cache(config, stage.lengths.shape[0], stage.max_len, fmt, num_loops=stage.num_loops,
                     plain_fmt=plain_fmt)
    ctx = CacheContext.build(row, stage.lengths, length, calib)

    def staged(x):  # [L, N, B, K, S, D] -> the first `length` positions
        return jax.lax.slice_in_dim(x, 0, length, axis=base.TOKEN_AXIS)

    k, v = map(staged, stage.dense_kv("looped"))
    looped = tuple((base.split_loops(k, seg), base.split_loops(v, seg)) for seg in row.schedule("looped")[1])
    plain = None
    if row.plain is not None:
        (seg,) = row.schedule("plain")[1]
        plain = tuple(base.split_loops(staged(x), seg) for x in stage.dense_kv("plain"))
    return ctx.finish(looped, plain)[0]


def _rows(cache: KVCache, fn, *others: KVCache) -> KVCache:
    """`cache` with `fn(axis, leaf, *other_leaves)` applied to every leaf along its batch axis: the state
    leaves [G, N, B, K, S, ...] along axis 2, the per-row counters along axis 0; the others held as
    `cache` is (values or bits, `KVCache.as_bits`)."""
    others = tuple(o if cache.bit_dtypes is None else o.as_bits() for o in others)

    def along(axis):
        return functools.partial(jax.tree_util.tree_map, functools.partial(fn, axis))

    state, per_row = along(2), along(0)
    return cache.replace(looped=state(cache.looped, *(c.looped for c in others)),
                         plain=None if cache.plain is None else state(cache.plain, *(c.plain for c in others)),
                         lengths=per_row(cache.lengths, *(c.lengths for c in others)),
                         overflow=per_row(cache.overflow, *(c.overflow for c in others)),
                         out_of_range=per_row(cache.out_of_range, *(c.out_of_range for c in others)),
                         steps=None if cache.steps is None else per_row(cache.steps, *(c.steps for c in others)))


def insert_rows(cache: KVCache, rows: KVCache, start: Int[Array, ""]) -> KVCache:
    """`cache` with rows [start, start + R) replaced by the R-row cache `rows` (same format and length)."""
    def put(axis, big, small):
        return base.on_bits(lambda b, s: jax.lax.dynamic_update_slice_in_dim(b, s, start, axis), big, small)

    return _rows(cache, put, rows)


def scatter_rows(cache: KVCache, rows: KVCache, ids: Int[Array, "r"]) -> KVCache:
    """`cache` with row ids[r] replaced by row r of `rows` (same format and length); an id ≥ B (padding)
    writes nothing."""
    def put(axis, big, small):
        return base.on_bits(lambda b, s: b.at[(slice(None),) * axis + (ids,)].set(s, mode="drop"), big, small)

    return _rows(cache, put, rows)


def first_rows(cache: KVCache, count: int) -> KVCache:
    """Rows [0, count) of `cache` (`count` static)."""
    def take(axis, leaf):
        return jax.lax.slice_in_dim(leaf, 0, count, axis=axis)

    return _rows(cache, take)


def scatter_slots(slots: Slots, ids: Int[Array, "r"], new: Slots) -> Slots:
    """`slots` with slot ids[r] set to row r of `new` (R rows: entering requests' first tokens and
    sampling); an id ≥ B (padding) writes nothing."""
    return jax.tree_util.tree_map(lambda big, small: big.at[ids].set(small, mode="drop"), slots, new)


def prefill_batch(model, config: ModelConfig, fmt, plain_fmt, calib: CacheCalib | None, cache: KVCache,
                  slots: Slots, stage: KVCache, tokens: Int[Array, "p t"], num_new: Int[Array, "p"],
                  seeds: Int[Array, "p"], sampling: Slots, ids: Int[Array, "p"], count: Int[Array, ""],
                  **model_kwargs) -> tuple[KVCache, Slots, Picked]:
    """The first `count` of P requests whose prompts fit one chunk (row p: num_new[p] of its T tokens
    real, seed seeds[p], sampling row p) prefilled into the empty G-row staging cache `stage`, G rows at
    a time (G divides P; a loop over the ceil(count / G) groups that hold requests, so the cost follows
    the requests, not P), encoded once into `fmt` and scattered into slots ids [P] with their first
    tokens (an id ≥ B: a padding row, dropped). Row p is the one-row prefill of its request: its own key
    chain (`request_keys(seeds[p])`; Huginn's noise per row key) and its own choice; attention never
    crosses rows. Picked: [P] (rows of groups past `count` are zeros)."""
    g, p = stage.lengths.shape[0], tokens.shape[0]

    def group(i, carry):
        cache, slots, picked = carry
        take = functools.partial(jax.tree_util.tree_map, lambda x: jax.lax.dynamic_slice_in_dim(x, i * g, g))
        rows_ids, rows_sampling = take(ids), take(sampling)
        keys = jax.vmap(request_keys)(take(seeds))  # [G, 3]: rng, model_rng, pick_rng
        out = model(take(tokens), stage, num_new=take(num_new), rng=keys[:, 1], last_only=True, **model_kwargs)
        new = choose(out.logits, rows_sampling, keys[:, 2])
        row = encode_row(config, fmt, plain_fmt, out.cache, calib, length=tokens.shape[1])
        cache = scatter_rows(cache, row, rows_ids)
        slots = scatter_slots(slots, rows_ids, rows_sampling.replace(last=new.tokens, rng=keys[:, 0]))
        picked = jax.tree_util.tree_map(lambda acc, x: jax.lax.dynamic_update_slice_in_dim(acc, x, i * g, 0),
                                        picked, new)
        return cache, slots, picked

    n = TOP_LOGPROBS
    empty = Picked(jnp.zeros(p, jnp.int32), jnp.zeros(p, jnp.float32), jnp.zeros((p, n), jnp.int32),
                   jnp.zeros((p, n), jnp.float32))
    return jax.lax.fori_loop(0, (count + g - 1) // g, group, (cache, slots, empty))


def decode_slots(model, calib: CacheCalib | None, cache: KVCache, slots: Slots, active: Bool[Array, "r"],
                 **model_kwargs) -> tuple[KVCache, Slots, Picked]:
    """One token for every active slot among the first R (R = len(active), static; the inactive ones and
    the slots past R compute and store nothing): the shared decode step on each slot's last token
    with its model key, then each slot's choice under its own parameters and pick key. Picked: [R]."""
    count = active.shape[0]
    part = cache if count == cache.lengths.shape[0] else first_rows(cache, count)
    mine = jax.tree_util.tree_map(lambda x: x[:count], slots)
    keys = jax.vmap(functools.partial(jax.random.split, num=3))(mine.rng)
    out = sampling.decode_step(model, mine.last, part, calib=calib, rng=keys[:, 1], active=active, **model_kwargs)
    picked = choose(out.logits, mine, keys[:, 2])
    mine = mine.replace(last=jnp.where(active, picked.tokens, mine.last), rng=keys[:, 0])
    if count < cache.lengths.shape[0]:
        out = out._replace(cache=insert_rows(cache, out.cache, jnp.int32(0)))

    def put(big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small, 0, 0)

    return out.cache, jax.tree_util.tree_map(put, slots, mine), picked
