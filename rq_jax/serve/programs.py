"""The serving engine's compiled pieces: pure functions over a batched `KVCache` whose rows are decode slots.

    prefill_chunk   one request's prompt chunk [1, T] into its staging row, a dense cache in the compute
                    dtype (every chunk reads the earlier ones exactly as its own in-flight K/V)
    encode_row      the staged prompt written once into a row of the served format (one `write`, as a
                    single-call prefill writes it)
    insert_row      a row cache into slot i of the batched cache: every leaf's batch axis
    decode_step     one token for every slot, each with its own sampling parameters and PRNG key

`forward(params, calib, tokens, cache, num_new, rng, last_only)` is the model call (static keywords
bound); the engine jits these with it. Each slot follows the `Sampler`'s PRNG chain for its request
alone — `rng, model_rng, pick_rng = split(key, 3)` per call — so a request's tokens never depend on its
batch-mates.

Shapes: B slots · T chunk tokens · V vocab · n `TOP_LOGPROBS`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.context import CacheContext
from rq_jax.cache.kv import KVCache, init_cache
from rq_jax.config import ModelConfig

#: Alternatives reported per token (OpenAI's completions allow up to 5).
TOP_LOGPROBS = 5

Forward = Callable[..., "object"]


@struct.dataclass
class Slots:
    """Per-slot decode inputs: each slot's last token and its request's sampling parameters and key."""

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


def sample_row(logits: Float[Array, "v"], key: jax.Array, temperature: Float[Array, ""], top_k: Int[Array, ""],
               top_p: Float[Array, ""]) -> Int[Array, ""]:
    """`rq_jax.sampling.choose_tokens` for one row with traced parameters: argmax at temperature 0,
    else a sample from softmax(logits / T) restricted by top-k (0: off) then top-p (1: off), drawn as
    a batch of one row (the same draw as the Sampler's for a one-prompt batch)."""
    x = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    kth = jnp.sort(x)[::-1][jnp.clip(top_k - 1, 0, x.shape[0] - 1)]
    x = jnp.where((top_k > 0) & (x < kth), -jnp.inf, x)
    order = jnp.argsort(-x)
    probs = jax.nn.softmax(x[order])
    keep = jnp.zeros(x.shape, bool).at[order].set(jnp.cumsum(probs) - probs < top_p)  # always keeps the top token
    x = jnp.where((top_p < 1) & ~keep, -jnp.inf, x)
    sample = jax.random.categorical(key, x[None], axis=-1)[0].astype(jnp.int32)
    return jnp.where(temperature > 0, sample, jnp.argmax(logits).astype(jnp.int32))


def top_logprobs(logits: Float[Array, "... v"]) -> tuple[Float[Array, "... v"], Int[Array, "... n"],
                                                         Float[Array, "... n"]]:
    """Log-softmax of `logits` and its `TOP_LOGPROBS` largest entries (ids, values)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return logp, ids.astype(jnp.int32), values


def choose(logits: Float[Array, "b v"], slots: Slots, keys: jax.Array) -> Picked:
    """Each row's token under its own parameters and pick key [B], with log-probabilities."""
    tokens = jax.vmap(sample_row)(logits, keys, slots.temperature, slots.top_k, slots.top_p)
    logp, ids, values = top_logprobs(logits)
    return Picked(tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], ids, values)


def request_keys(seed: Int[Array, ""]) -> jax.Array:
    """A request's (rng, model_rng, pick_rng) of its prefill, as the Sampler splits `key(seed)`: [3] keys."""
    return jax.random.split(jax.random.key(seed), 3)


def prefill_chunk(forward: Forward, echo: bool, params, tokens: Int[Array, "1 t"], num_new: Int[Array, "1"],
                  stage: KVCache, model_rng: jax.Array, sampling: Slots, pick_rng: jax.Array,
                  targets: Int[Array, "1 t"] | None = None) -> tuple[KVCache, Picked, PromptLogprobs | None]:
    """Run a prompt chunk (num_new[0] of its T tokens real) into the staging row `stage`; the token
    chosen after its last real token (used after the prompt's last chunk) and, with `echo`, the
    log-probabilities of `targets` (the prompt's next tokens) at every position."""
    out = forward(params, None, tokens, stage, num_new, model_rng, not echo)
    logits, prompt = out.logits, None
    if echo:
        logp, ids, values = top_logprobs(logits)
        prompt = PromptLogprobs(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], ids, values)
        logits = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return out.cache, choose(logits, sampling, pick_rng[None]), prompt


def encode_row(config: ModelConfig, fmt, plain_fmt, stage: KVCache, calib: CacheCalib | None) -> KVCache:
    """The staged prompt (dense, compute dtype) as a one-row cache of `fmt` (`plain_fmt` for Huginn's
    prelude/coda): every loop's K/V written in one call, as a single-call prefill writes them."""
    row = init_cache(config, 1, stage.max_len, fmt, num_loops=stage.num_loops, plain_fmt=plain_fmt)
    ctx = CacheContext.build(row, stage.lengths, stage.max_len, calib)
    k, v = stage.dense_kv("looped")
    looped = tuple((base.split_loops(k, seg), base.split_loops(v, seg)) for seg in row.schedule("looped")[1])
    plain = None
    if row.plain is not None:
        (seg,) = row.schedule("plain")[1]
        plain = tuple(base.split_loops(x, seg) for x in stage.dense_kv("plain"))
    return ctx.finish(looped, plain)[0]


def insert_row(cache: KVCache, row: KVCache, slot: Int[Array, ""]) -> KVCache:
    """`cache` with slot `slot` replaced by the one-row cache `row` (same format and length): state leaves
    [G, N, B, K, S, ...] along axis 2, the per-row counters along axis 0."""
    def along(axis):
        return functools.partial(jax.tree_util.tree_map,
                                 lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype),
                                                                                        slot, axis))

    per_row = along(0)
    return cache.replace(looped=along(2)(cache.looped, row.looped),
                         plain=None if cache.plain is None else along(2)(cache.plain, row.plain),
                         lengths=per_row(cache.lengths, row.lengths), overflow=per_row(cache.overflow, row.overflow),
                         out_of_range=per_row(cache.out_of_range, row.out_of_range),
                         steps=None if cache.steps is None else per_row(cache.steps, row.steps))


def insert_slot(slots: Slots, slot: Int[Array, ""], first: Int[Array, "1"], sampling: Slots) -> Slots:
    """`slots` with slot `slot` set to a new request's first token [1] and its one-row sampling `sampling`."""
    def put(big, small):
        return big.at[slot].set(small[0])

    return jax.tree_util.tree_map(put, slots, sampling.replace(last=first))


def decode_step(forward: Forward, params, calib: CacheCalib | None, cache: KVCache, slots: Slots,
                active: Bool[Array, "b"]) -> tuple[KVCache, Slots, Picked]:
    """One token for every active slot (the inactive ones compute and store nothing): the model on each
    slot's last token, then each slot's choice under its own parameters and key."""
    keys = jax.vmap(functools.partial(jax.random.split, num=3))(slots.rng)
    out = forward(params, calib, slots.last[:, None], cache, active.astype(jnp.int32), keys[:, 1], True)
    picked = choose(out.logits, slots, keys[:, 2])
    last = jnp.where(active, picked.tokens, slots.last)
    return out.cache, slots.replace(last=last, rng=keys[:, 0]), picked
