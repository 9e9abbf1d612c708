"""The serving engine's compiled pieces: one model call over a step's rows of a paged `KVCache`, and the choice
of each row's next token under its own sampling parameters and PRNG key.

    step_keys   per row, the keys of its call: a prompt chunk's from the request's seed (the Sampler's
                `request_keys`, Huginn's noise folded with the chunk's index when the prompt runs in several
                chunks), a decode row's by splitting the request's chain key (the Sampler's decode step)
    run_rows    the model over rows [R, T] of a paged cache (their lengths and block tables), each row's
                pick after its last real token, and with `targets` the prompt's log-probabilities

Each request follows the Sampler's PRNG chain for its prompt alone — `rng, model_rng, pick_rng = split(key,
3)` per call — so its tokens never depend on its batch-mates. Shapes: R rows · T tokens · V vocab · n
`TOP_LOGPROBS`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from rq_jax import sampling
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv import KVCache

#: Alternatives reported per token (OpenAI's completions allow up to 5).
TOP_LOGPROBS = 5


class Sampling(NamedTuple):
    """Per-row sampling parameters [R]: temperature (0: greedy), top-k (0: off), top-p (1: off)."""

    temperature: Float[Array, "r"]
    top_k: Int[Array, "r"]
    top_p: Float[Array, "r"]


class RowKeys(NamedTuple):
    """Per-row PRNG inputs [R]: a prompt chunk's request seed and chunk index (-1: a prompt of one chunk), a
    decode row's chain key (raw key data [R, 2])."""

    seed: Int[Array, "r"]
    chunk: Int[Array, "r"]
    rng: UInt32[Array, "r 2"]


class Picked(NamedTuple):
    """Chosen tokens [R], their log-probabilities under the model (log-softmax of the raw logits) [R],
    and the n most likely tokens with theirs [R, n]."""

    tokens: Int[Array, "r"]
    logprob: Float[Array, "r"]
    top_ids: Int[Array, "r n"]
    top_logprobs: Float[Array, "r n"]


class PromptLogprobs(NamedTuple):
    """Per position t: log-probability of the prompt's token t + 1 [R, T] and the top n [R, T, n]."""

    logprob: Float[Array, "r t"]
    top_ids: Int[Array, "r t n"]
    top_logprobs: Float[Array, "r t n"]


def top_logprobs(logits: Float[Array, "... v"]) -> tuple[Float[Array, "... v"], Int[Array, "... n"],
                                                         Float[Array, "... n"]]:
    """Log-softmax of `logits` and its `TOP_LOGPROBS` largest entries (ids, values)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return logp, ids.astype(jnp.int32), values


def choose(logits: Float[Array, "r v"], params: Sampling, keys: jax.Array) -> Picked:
    """Each row's token under its own parameters and pick key [R], with log-probabilities: argmax at
    temperature 0, else a draw from `sampling.restrict_logits` of its row as a batch of one row (the
    Sampler's draw for a one-prompt batch). What no row needs is skipped at run time (`lax.cond`): the
    draws when every row is greedy, the top-k/top-p sorts when no row filters — they cost more than the
    rest of a small model's decode step on a CPU."""
    sampled_rows = params.temperature > 0
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(logits):
        temperature = jnp.where(sampled_rows, params.temperature, 1.0)
        filtered = sampled_rows & ((params.top_k > 0) | (params.top_p < 1))
        restricted = jax.lax.cond(
            jnp.any(filtered),
            lambda x: sampling.restrict_logits(x, temperature, params.top_k, params.top_p),
            lambda x: x.astype(jnp.float32) / temperature[:, None], logits)
        return jax.vmap(lambda key, row: jax.random.categorical(key, row[None], axis=-1)[0])(keys, restricted)

    drawn = jax.lax.cond(jnp.any(sampled_rows), sample, lambda _: greedy, logits)
    tokens = jnp.where(sampled_rows, drawn.astype(jnp.int32), greedy)
    logp, ids, values = top_logprobs(logits)
    return Picked(tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], ids, values)


def request_keys(seed: Int[Array, ""]) -> jax.Array:
    """A request's (rng, model_rng, pick_rng) of its prefill, as the Sampler splits `key(seed)`: [3] keys."""
    return jax.random.split(jax.random.key(seed), 3)


def step_keys(keys: RowKeys, prefill: bool) -> tuple[jax.Array, jax.Array, UInt32[Array, "r 2"]]:
    """(model keys [R], pick keys [R], the chain keys that follow, as raw data [R, 2]) of a step's rows: prompt
    chunks (`prefill`) from their request's seed, the model's key folded with the chunk's index when the
    prompt runs in several chunks (as `sampling.prefill` folds it); decode rows split their chain key."""
    if prefill:
        split = jax.vmap(request_keys)(keys.seed)  # [R, 3]
        folded = jax.vmap(jax.random.fold_in)(split[:, 1], jnp.maximum(keys.chunk, 0))
        model = jnp.where((keys.chunk >= 0)[:, None], jax.random.key_data(folded), jax.random.key_data(split[:, 1]))
        return jax.random.wrap_key_data(model), split[:, 2], jax.random.key_data(split[:, 0])
    split = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k), 3))(keys.rng)
    return split[:, 1], split[:, 2], jax.random.key_data(split[:, 0])


def run_rows(model, calib: CacheCalib | None, cache: KVCache, tokens: Int[Array, "r t"], num_new: Int[Array, "r"],
             params: Sampling, keys: RowKeys, prefill: bool, targets: Int[Array, "r t"] | None = None,
             **model_kwargs) -> tuple[KVCache, Picked, UInt32[Array, "r 2"], PromptLogprobs | None]:
    """One model call over a step's rows (row r: num_new[r] of its T tokens real, from position
    cache.lengths[r], its K/V written through cache.block_table[r]): the updated cache, each row's pick
    after its last real token, the chain keys that follow, and with `targets` (the prompt's next tokens)
    the log-probabilities of every position."""
    model_keys, pick_keys, next_rng = step_keys(keys, prefill)
    out = model(tokens, cache, num_new=num_new, rng=model_keys, last_only=targets is None, calib=calib,
                **model_kwargs)
    logits, prompt = out.logits, None
    if targets is not None:
        logp, ids, values = top_logprobs(logits)
        prompt = PromptLogprobs(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], ids, values)
        logits = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return out.cache, choose(logits, params, pick_keys), next_rng, prompt
