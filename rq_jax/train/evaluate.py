"""Held-out evaluation: exact match on addition and retrieval answers, bits per byte on stdlib text.

Exact match under greedy decoding is computed from one teacher-forced forward: greedy decoding
reproduces an answer iff, at every answer position, the argmax given the prompt and the answer's
earlier tokens is the answer's token (the first wrong argmax is what greedy would emit). `greedy_decode`
is the plain token-by-token loop (no cache); a test checks the two agree.
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


def forward_kwargs(family: str, loops: int) -> dict:
    """The loop-count keyword of a family's forward call."""
    return {"num_loops": loops} if family == "ouro" else {"num_steps": loops}


def make_score_fn(graphdef, rest, family: str, loops: int) -> ScoreFn:
    """A jitted teacher-forced scorer (compiles once per tokens shape and model structure)."""
    score = _jitted_score(graphdef, family, loops)
    return lambda params, tokens: score(params, rest, tokens)


@functools.lru_cache(maxsize=8)
def _jitted_score(graphdef, family: str, loops: int):
    kw = forward_kwargs(family, loops)

    @jax.jit
    def score(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest)
        logits = model(tokens[:, :-1], **kw).logits
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


def answer_scores(score: ScoreFn, params, examples: Sequence[Example], length: int, batch: int = 32) -> dict[str, float]:
    """"em": the fraction of the examples' answers that greedy decoding gets exactly right (each answer
    given the correct text before it); "token_acc": the fraction of answer tokens whose argmax is right
    (a finer signal early in training)."""
    tokens, answer_id = collate(examples, length)
    preds, _ = score_batches(score, params, tokens, batch)
    is_answer = answer_id[:, 1:] > 0
    return {"em": float(np.mean(answer_exact_match(preds, tokens, answer_id))),
            "token_acc": float(np.mean((preds == tokens[:, 1:])[is_answer]))}


def exact_match(score: ScoreFn, params, examples: Sequence[Example], length: int, batch: int = 32) -> float:
    """`answer_scores(...)["em"]`."""
    return answer_scores(score, params, examples, length, batch)["em"]


def bits_per_byte(score: ScoreFn, params, windows: np.ndarray, batch: int = 32) -> float:
    """Mean NLL in bits of every token of windows [N, T] after the first (all byte tokens here)."""
    _, nll = score_batches(score, params, windows, batch)
    mask = windows[:, 1:] != EOS
    return float(np.sum(nll * mask) / np.sum(mask) / math.log(2))


def greedy_decode(model, prompt: np.ndarray, num_tokens: int, forward_kw: dict, length: int | None = None) -> np.ndarray:
    """Plain greedy decoding without a cache: append argmax num_tokens times to prompt [P] → [num_tokens].

    Each step runs the whole sequence (right-padded to `length`, default P + num_tokens, one shape)."""
    length = length or len(prompt) + num_tokens
    buf = np.full((1, length), EOS, np.int32)
    buf[0, : len(prompt)] = prompt
    fwd = nnx.jit(lambda m, t: m(t, **forward_kw).logits)
    pos = len(prompt)
    for _ in range(num_tokens):
        logits = fwd(model, jnp.asarray(buf))
        buf[0, pos] = int(jnp.argmax(logits[0, pos - 1]))
        pos += 1
    return buf[0, len(prompt) : pos]
