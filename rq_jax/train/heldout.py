"""Held-out scores during training: exact match on addition and retrieval answers, bits per byte on
stdlib text, from teacher-forced forwards of a dense model (no cache; `rq_jax.eval` scores through one).

Exact match under greedy decoding is computed from one teacher-forced forward: greedy decoding
reproduces an answer iff, at every answer position, the argmax given the prompt and the answer's
earlier tokens is the answer's token (the first wrong argmax is what greedy would emit); a test checks
it against plain token-by-token greedy decoding.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rq_jax.data import EOS, Example, collate

#: (params, tokens [N, T]) → (argmax [N, T - 1] int32, nll [N, T - 1] float32 of tokens[:, 1:]).
ScoreFn = Callable[[nnx.State, jax.Array], tuple[jax.Array, jax.Array]]


def make_score_fn(graphdef, rest, loops: int) -> ScoreFn:
    """A jitted teacher-forced scorer running `loops` loops (compiles once per tokens shape and model
    structure)."""
    score = _jitted_score(graphdef, loops)

    def scorer(params, tokens):
        return score(params, rest, tokens)

    return scorer


@functools.lru_cache(maxsize=8)
def _jitted_score(graphdef, loops: int):
    @jax.jit
    def score(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest)
        logits = model(tokens[:, :-1], num_loops=loops).logits
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), nll

    return score


def score_batches(score: ScoreFn, params, tokens: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """`score` over rows of tokens [N, T] in chunks of `batch` (the last chunk padded, so one shape)."""
    preds, nlls = [], []
    for i in range(0, len(tokens), batch):
        chunk = tokens[i : i + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.full((pad, chunk.shape[1]), EOS, np.int32)])
        p, n = score(params, jnp.asarray(chunk))
        preds.append(np.asarray(p)[: batch - pad])
        nlls.append(np.asarray(n)[: batch - pad])
    return np.concatenate(preds), np.concatenate(nlls)


def answer_exact_match(preds: np.ndarray, tokens: np.ndarray, answer_id: np.ndarray) -> np.ndarray:
    """Per-answer exact match [num answers] bool from argmax preds [N, T - 1] of tokens [N, T]."""
    target_ids = answer_id[:, 1:]
    correct = preds == tokens[:, 1:]
    out = []
    for row in range(len(tokens)):
        for k in range(1, int(target_ids[row].max(initial=0)) + 1):
            out.append(bool(np.all(correct[row][target_ids[row] == k])))
    return np.array(out, bool)


def answer_scores(score: ScoreFn, params, examples: Sequence[Example], length: int,
                  batch: int = 32) -> dict[str, float]:
    """"em": the fraction of the examples' answers that greedy decoding gets exactly right (each answer
    given the correct text before it); "token_acc": the fraction of answer tokens whose argmax is right
    (a finer signal early in training)."""
    tokens, answer_id = collate(examples, length)
    preds, _ = score_batches(score, params, tokens, batch)
    is_answer = answer_id[:, 1:] > 0
    return {"em": float(np.mean(answer_exact_match(preds, tokens, answer_id))),
            "token_acc": float(np.mean((preds == tokens[:, 1:])[is_answer]))}


def bits_per_byte(score: ScoreFn, params, windows: np.ndarray, batch: int = 32) -> float:
    """Mean NLL in bits of every token of windows [N, T] after the first (all byte tokens here)."""
    _, nll = score_batches(score, params, windows, batch)
    mask = windows[:, 1:] != EOS
    return float(np.sum(nll * mask) / np.sum(mask) / math.log(2))
