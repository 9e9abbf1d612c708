"""The measurement floor: jit-compiled, batched loops that score a model *through* a cache format, and
the statistics of their scores (KL, agreement, NLL, exact match, the paired bootstrap). The eval
runners (`rq_jax.eval`), the bit allocator (`rq_jax.calibrate.allocate`) and QAT's held-out
evaluation all measure with it, so none of them imports another for it.

`CacheScorer` prefills each row's prefix into two caches — the format under test and a dense
reference — then feeds the rest of the row one token per call (a decode step, so every token reads
its past from the compressed cache, as in generation), and scores, at every position j past the
prefix, the next-token distribution predicting tokens[j]: its NLL, its KL from the dense cache's
distribution, and whether its argmax is right and agrees with the dense argmax. One prefill and one
`lax.while_loop` per batch; each compiles once per batch shape.

Greedy exact match follows from these scores without a second decoding pass: greedy decoding through
the cache reproduces an answer iff the argmax is right at every answer position when the answer's
earlier tokens are fed back — which is exactly what the token-by-token feed does (a test checks it
against the Sampler's free-running greedy answers). Later answers of a multi-answer example see the
true earlier answers (teacher forcing between answers, token by token through the cache).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rq_jax import setup, sharding
from rq_jax.cache.base import CacheFormat
from rq_jax.cache.dense import Dense
from rq_jax.cache.calib import CacheCalib, default_calib, fit_calib
from rq_jax.cache.kv import init_cache
from rq_jax.data import EOS, Example, collate
from rq_jax.sampling import decode_step


class Scores(NamedTuple):
    """Per-position scores [B, T] of rows scored through a cache (numpy on the host).

    Entry j scores the distribution predicting tokens[b, j]; `scored[b, j]` is True for
    prefix[b] ≤ j < length[b] (elsewhere every field is 0 / False).
    """

    scored: Bool[np.ndarray, "b t"]
    nll: Float[np.ndarray, "b t"]  # nats, through the format's cache
    ref_nll: Float[np.ndarray, "b t"]  # nats, through the dense reference cache
    kl: Float[np.ndarray, "b t"]  # KL(reference ‖ format) of the next-token distributions, nats
    correct: Bool[np.ndarray, "b t"]  # argmax == tokens[b, j], through the format's cache
    ref_correct: Bool[np.ndarray, "b t"]  # the same through the reference cache
    agree: Bool[np.ndarray, "b t"]  # the two argmaxes are equal
    out_of_range: Int[np.ndarray, "b"]  # values the format could not store (`KVCache.out_of_range`)


class _Carry(NamedTuple):
    caches: tuple  # (format cache, reference cache)
    step: Int[Array, ""]
    out: tuple  # Scores fields as [B, T] arrays


def _token_scores(logits, ref_logits, target):
    """Scores of logits [B, V] and reference logits [B, V] for targets [B]: the Scores fields but scored."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lr = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    def pick(x):
        return jnp.take_along_axis(x, target[:, None], axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(lr) * (lr - lp), axis=-1)
    guess, ref_guess = jnp.argmax(lp, axis=-1), jnp.argmax(lr, axis=-1)
    return -pick(lp), -pick(lr), kl, guess == target, ref_guess == target, guess == ref_guess


class CacheScorer:
    """Score rows through a cache of format `fmt` against a dense `reference` cache (float32).

    `calib`: the formats' calibration; when None, formats that need data are fitted per batch on its
    rows' prefixes (a dense prefill first, as the Sampler does for prompts), the others use their
    `default_calib`, built once here. `model_kwargs` go to every model call (e.g. `num_loops`). Both
    caches see identical calls, including Huginn's random initial state (seeded per call). With a
    `mesh` (axes `data`, `model`; `rq_jax.sharding`) params, calibration, rows and caches are sharded
    (batch over `data`, kv heads over `model`): keep the batch a multiple of the `data` size.
    """

    def __init__(self, model, fmt: CacheFormat, *, plain_fmt: CacheFormat | None = None,
                 reference: CacheFormat = Dense("float32"), calib: CacheCalib | None = None, seed: int = 0,
                 mesh: Mesh | None = None, **model_kwargs):
        self.mesh = mesh
        self.config = model.config
        self.fmt, self.plain_fmt, self.reference = fmt, plain_fmt or fmt, reference
        self.model_kwargs, self.seed = model_kwargs, seed
        self.graphdef, self.params, self.num_loops, self.calib, self.needs_data = setup.prepare(
            model, self.fmt, self.plain_fmt, calib=calib, mesh=mesh, **model_kwargs)
        self.ref_calib = sharding.shard_calib(
            default_calib(jax.eval_shape(lambda: self._cache(reference, reference, 1, 1))), mesh, reference)
        self._calibrate = setup.jit(self._calibrate_fn)
        self._score = setup.jit(self._score_fn)

    def _cache(self, fmt, plain_fmt, batch, max_len):
        cache = init_cache(self.config, batch, max_len, fmt, num_loops=self.num_loops, plain_fmt=plain_fmt)
        return sharding.constrain_cache(cache, self.mesh)

    def num_compiled(self) -> int:
        """How many scoring programs have been compiled (one per batch shape)."""
        return self._score._cache_size()

    def _rng(self, call: int) -> jax.Array:
        """Huginn's initial-state key of the row's `call`-th model call (the same for both caches)."""
        return jax.random.fold_in(jax.random.key(self.seed), call)

    def _call(self, params, tokens, cache, num_new, calib, step):
        model = nnx.merge(self.graphdef, params)
        return model(tokens, cache, num_new=num_new, rng=self._rng(step), last_only=True, calib=calib,
                     **self.model_kwargs)

    def _calibrate_fn(self, params, tokens, prefix):
        dense = self._cache(Dense("float32"), Dense("float32"), *tokens.shape)
        out = self._call(params, tokens, dense, prefix, None, 0)
        calib = fit_calib(out.cache, self.fmt, self.plain_fmt)
        return sharding.constrain(calib, sharding.calib_specs(calib, self.mesh, self.fmt, self.plain_fmt), self.mesh)

    def _score_fn(self, params, calib, tokens, prefix, lengths):
        b, t = tokens.shape
        rows = jnp.arange(b)
        caches = (self._cache(self.fmt, self.plain_fmt, b, t).held(),  # loop carries: written in place
                  self._cache(self.reference, self.reference, b, t).held())
        calibs = (calib, self.ref_calib)

        def record(out, pos, logits):
            """Write the scores of logits (predicting tokens[b, pos[b]]) where pos < lengths."""
            live = pos < lengths
            at = jnp.minimum(pos, t - 1)
            new = _token_scores(*logits, tokens[rows, at])
            return tuple(o.at[rows, at].set(jnp.where(live, n, o[rows, at])) for o, n in zip(out, new))

        outs = [self._call(params, tokens, c, prefix, cal, 0) for c, cal in zip(caches, calibs)]
        zeros = (jnp.zeros((b, t), jnp.float32),) * 3 + (jnp.zeros((b, t), bool),) * 3
        first = record(zeros, prefix, [o.logits for o in outs])
        steps = jnp.max(lengths - prefix - 1)  # feeds of tokens prefix .. length - 2

        def body(c: _Carry) -> _Carry:
            pos = prefix + c.step  # the token fed now; its logits predict pos + 1
            live = pos + 1 < lengths
            fed = tokens[rows, jnp.minimum(pos, t - 1)]
            model, rng = nnx.merge(self.graphdef, params), self._rng(c.step + 1)
            outs = [decode_step(model, fed, cache, calib=cal, rng=rng, active=live, **self.model_kwargs)
                    for cache, cal in zip(c.caches, calibs)]
            caches = tuple(sharding.constrain_cache(o.cache, self.mesh) for o in outs)
            return _Carry(caches, c.step + 1, record(c.out, pos + 1, [o.logits for o in outs]))

        start = _Carry(tuple(o.cache for o in outs), jnp.int32(0), first)
        final = jax.lax.while_loop(lambda c: c.step < steps, body, start)
        scored = (jnp.arange(t)[None] >= prefix[:, None]) & (jnp.arange(t)[None] < lengths[:, None])
        return (scored, *final.out, final.caches[0].out_of_range)

    def __call__(self, tokens: np.ndarray, prefix: np.ndarray, lengths: np.ndarray) -> Scores:
        """Score rows tokens [B, T] (int32): prefill tokens[b, :prefix[b]], then feed one token per call
        up to lengths[b] − 2, scoring positions prefix[b] .. lengths[b] − 1. Needs 1 ≤ prefix ≤ length
        ≤ T per row (a row with prefix == length is not scored: padding)."""
        tokens, prefix, lengths = (np.asarray(x, np.int32) for x in (tokens, prefix, lengths))
        if tokens.ndim != 2 or prefix.shape != lengths.shape != (tokens.shape[0],):
            raise ValueError(f"need tokens [B, T] with prefix and lengths [B], got {tokens.shape}, "
                             f"{prefix.shape}, {lengths.shape}")
        if not (np.all(1 <= prefix) and np.all(prefix <= lengths) and np.all(lengths <= tokens.shape[1])):
            raise ValueError(f"need 1 ≤ prefix ≤ length ≤ {tokens.shape[1]} per row, got prefix {prefix.tolist()} "
                             f"and lengths {lengths.tolist()}")
        if self.mesh is not None:
            tokens, prefix, lengths = sharding.put((tokens, prefix, lengths),
                                                   sharding.batch_sharding(self.mesh, tokens.shape))
        calib = self.calib
        if calib is None:
            calib = self._calibrate(self.params, tokens, prefix)
        return Scores(*map(np.asarray, sharding.to_host(self._score(self.params, calib, tokens, prefix, lengths))))


def score_examples(scorer: CacheScorer, examples: Sequence[Example], length: int, batch: int,
                   progress: Callable[[int], None] | None = None) -> tuple[Scores, np.ndarray, np.ndarray]:
    """Score examples (each alone in a row, prefix = the tokens before its first answer) in batches of
    `batch` rows of `length` tokens, the last batch padded with unscored rows (one shape, one compile).
    `progress(k)` is called after each batch with the k answers it scored.
    Returns the Scores [N, length], tokens [N, length] and answer_id [N, length]."""
    tokens, answer_id = collate(examples, length)
    prefix = np.array([len(ex.prompt(1)) for ex in examples], np.int32)
    lengths = np.array([len(ex) for ex in examples], np.int32)
    counts = np.array([ex.num_answers for ex in examples])
    return _batched(scorer, tokens, prefix, lengths, batch, progress, counts), tokens, answer_id


def score_windows(scorer: CacheScorer, windows: np.ndarray, prefix: int, batch: int,
                  progress: Callable[[int], None] | None = None) -> Scores:
    """Score text windows [N, T]: prefill the first `prefix` tokens, then feed the rest one by one;
    `progress(k)` after each batch of k windows."""
    n, t = windows.shape
    return _batched(scorer, windows, np.full(n, prefix, np.int32), np.full(n, t, np.int32), batch, progress,
                    np.ones(n, int))


def _batched(scorer, tokens, prefix, lengths, batch, progress, counts) -> Scores:
    parts = []
    for i in range(0, len(tokens), batch):
        pad = batch - len(tokens[i : i + batch])
        rows = [np.concatenate([x[i : i + batch], np.repeat(fill, pad, axis=0)])
                for x, fill in ((tokens, np.full((1, tokens.shape[1]), EOS, np.int32)),
                                (prefix, np.ones(1, np.int32)), (lengths, np.ones(1, np.int32)))]
        parts.append(Scores(*(x[: batch - pad] for x in scorer(*rows))))
        if progress is not None:
            progress(int(counts[i : i + batch].sum()))
    return Scores(*map(np.concatenate, zip(*parts)))


class AnswerResults(NamedTuple):
    """Per-answer outcomes (answers in example order) and the example each belongs to."""

    correct: np.ndarray  # [A] bool: greedy through the format's cache reproduces the answer
    ref_correct: np.ndarray  # [A] bool: the same through the dense reference cache
    example: np.ndarray  # [A] int: index of the answer's example


def answers(scores: Scores, answer_id: np.ndarray) -> AnswerResults:
    """Exact match of every answer: all its positions' argmaxes right (see the module docstring)."""
    out = ([], [], [])
    for row in range(len(answer_id)):
        for k in range(1, int(answer_id[row].max(initial=0)) + 1):
            span = answer_id[row] == k
            out[0].append(bool(np.all(scores.correct[row][span])))
            out[1].append(bool(np.all(scores.ref_correct[row][span])))
            out[2].append(row)
    return AnswerResults(*(np.array(x) for x in out))


def paired_bootstrap(a: np.ndarray, b: np.ndarray, groups: np.ndarray | None = None, *, samples: int = 2000,
                     level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) − mean(b) and its percentile bootstrap CI, resampling the pairs (a[i], b[i]) [N] — or,
    with `groups` [N], whole groups (answers of one example move together). Returns (diff, lo, hi)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    groups = np.arange(len(a)) if groups is None else np.asarray(groups)
    ids, inverse = np.unique(groups, return_inverse=True)
    sums = np.stack([np.bincount(inverse, a - b), np.bincount(inverse, np.ones_like(a))])  # per group
    pick = np.random.default_rng(seed).integers(0, len(ids), (samples, len(ids)))
    boot = sums[0][pick].sum(1) / sums[1][pick].sum(1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(np.mean(a - b)), float(lo), float(hi)


def task_metrics(scores: Scores, answer_id: np.ndarray) -> dict[str, float | int | str]:
    """Answer-level metrics of scored examples: accuracy (greedy exact match) through the format and
    the reference, the paired-bootstrap 95% CI of their difference, greedy agreement with the dense
    model on answer tokens, mean answer NLL (nats per token), mean KL over every scored position, the
    values the format could not store (`KVCache.out_of_range`, summed), and every answer's outcome
    (`correct_words`, for `paired_rows`)."""
    res = answers(scores, answer_id)
    on_answers = answer_id > 0
    diff, lo, hi = paired_bootstrap(res.correct, res.ref_correct, res.example)
    return {"accuracy": float(np.mean(res.correct)), "dense_accuracy": float(np.mean(res.ref_correct)),
            "accuracy_diff": diff, "accuracy_diff_lo": lo, "accuracy_diff_hi": hi,
            "agreement": float(np.mean(scores.agree[on_answers])),
            "answer_nll": float(np.mean(scores.nll[on_answers])),
            "kl": float(np.mean(scores.kl[scores.scored])), "out_of_range": int(np.sum(scores.out_of_range)),
            "correct": correct_words(res)}


def correct_words(res: AnswerResults) -> str:
    """Every answer's exact match as one word of 0/1 per example, e.g. "1 0 1" (three one-answer
    examples) or "1101 1111" (two of four answers each)."""
    return " ".join("".join("01"[int(c)] for c in res.correct[res.example == e]) for e in np.unique(res.example))


def paired_rows(a: str, b: str) -> tuple[float, float, float]:
    """Accuracy of `correct_words` a minus that of b on the same answers, with the paired-bootstrap 95%
    CI resampling whole examples: (diff, lo, hi). Raises ValueError when they score other answers."""
    wa, wb = a.split(), b.split()
    if [len(w) for w in wa] != [len(w) for w in wb]:
        raise ValueError("the two rows scored different answers (another --n, seed or data)")
    groups = np.repeat(np.arange(len(wa)), [len(w) for w in wa])
    return paired_bootstrap(*(np.array(list("".join(w))) == "1" for w in (wa, wb)), groups)


def text_metrics(scores: Scores) -> dict[str, float]:
    """Bits per byte through the format and the reference (every scored token is one byte), their
    agreement, mean KL over scored positions and the values the format could not store."""
    s = scores.scored
    return {"bpb": float(np.mean(scores.nll[s]) / math.log(2)),
            "dense_bpb": float(np.mean(scores.ref_nll[s]) / math.log(2)),
            "agreement": float(np.mean(scores.agree[s])), "kl": float(np.mean(scores.kl[s])),
            "out_of_range": int(np.sum(scores.out_of_range))}
