"""The accuracy-versus-memory table: every cache format of the paper's comparison scored on the held-out
tasks through the cache (see `loops`), with its exact storage cost.

The rows are the scheme catalog's (`rq_jax.cache.schemes.table_schemes`, and `calibrated_schemes` for
the rotation comparison, fitted by `rq_jax.calibrate.fit_rotations`); `evaluate(...)` fills one row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rq_jax.cache import CacheCalib, cache_nbytes, init_cache
from rq_jax.cache.schemes import Scheme
from rq_jax.data import Addition, Retrieval, StdlibText
from rq_jax import scoring


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The held-out evaluation sets: `n` answers per generated task (eval split: `n` addition examples,
    `n` retrieval queries in ⌈n / queries⌉ sequences; each task's rows as long as its longest example),
    `text_windows` stdlib windows of `text_len` tokens scored after a
    `text_prefix`-token prefill. Bits per element and bytes per token are counted at `length`."""

    n: int = 1000
    addition: Addition = Addition()
    retrieval: Retrieval = Retrieval()
    retrieval_pairs: int | None = 43  # every example at this many pairs (None: the generator's range)
    text_windows: int = 64
    text_len: int = 256
    text_prefix: int = 64
    seed: int = 0

    @property
    def length(self) -> int:
        """Row length that holds every example."""
        return max(self.addition.length, self.retrieval.max_length(self.retrieval_pairs), self.text_len)

    def num_answers(self) -> int:
        """What `evaluate` scores per row: the answers of `answer_sets` (sums, retrieval queries) and
        the text windows (the unit of its `progress`)."""
        return sum(ex.num_answers for _, examples, _ in self.answer_sets() for ex in examples) + self.text_windows

    def answer_sets(self) -> list[tuple[str, list, int]]:
        """(task, held-out examples, row length) of the answer tasks: `n` addition examples, and enough
        retrieval sequences for `n` queries (each query is one answer)."""
        queries = min(self.retrieval.num_queries, self.retrieval_pairs or self.retrieval.max_pairs)
        return [("addition", self.addition.examples("eval", self.n, self.seed), self.addition.length),
                ("retrieval", self.retrieval.examples("eval", -(-self.n // queries), self.seed,
                                                      num_pairs=self.retrieval_pairs),
                 self.retrieval.max_length(self.retrieval_pairs))]


def evaluate(model, scheme: Scheme, tasks: Tasks, *, batch: int = 32, text: StdlibText | None = None,
             calib: CacheCalib | None = None, mesh=None,
             progress: Callable[[str, int], None] = lambda status, answers: None, **model_kwargs) -> dict:
    """One table row: per-task metrics of `scoring.task_metrics` / `scoring.text_metrics` through the
    scheme's cache (with `calib` when given, else the format's default), bits per element (the
    format's accounting at the row length) and bytes per token (the arrays of a cache of
    `tasks.length` positions, batch 1, all layers). `mesh`: see `scoring.CacheScorer`.
    `progress(status, k)` reports, after each batch, the k answers (or text windows) it scored —
    `tasks.num_answers()` in all — and with k = 0 the task about to start."""
    scorer = scoring.CacheScorer(model, scheme.fmt, calib=calib, seed=tasks.seed, mesh=mesh, **model_kwargs)
    row = {"scheme": scheme.label, "ladder": scheme.ladder, "method": scheme.method or "default"}
    for name, examples, length in tasks.answer_sets():
        status = f"{scheme.label}: {name}"
        progress(status, 0)
        scores, _, answer_id = scoring.score_examples(scorer, examples, length, batch,
                                                    lambda k, status=status: progress(status, k))
        row[name] = scoring.task_metrics(scores, answer_id)
    status = f"{scheme.label}: text"
    progress(status, 0)
    text = text or StdlibText()
    windows = text.eval_windows(tasks.text_len, tasks.text_windows)
    row["text"] = scoring.text_metrics(scoring.score_windows(scorer, windows, tasks.text_prefix, batch,
                                                         lambda k: progress(status, k)))
    cache = init_cache(model.config, 1, tasks.length, scheme.fmt, num_loops=scorer.num_loops)
    row["bytes_per_token"] = cache_nbytes(cache) / tasks.length
    row["bits_per_element"] = float(scheme.fmt.bits_per_element(scorer.num_loops, model.config.head_dim, tasks.length))
    return row


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (bits, accuracy) points that no point with as few bits or fewer matches, in order of bits:
    the best accuracy reachable at each storage cost (the accuracy figures draw it)."""
    front = []
    for bits, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or acc > front[-1][1]:
            front.append((bits, acc))
    return front
