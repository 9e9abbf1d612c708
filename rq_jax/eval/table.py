"""The accuracy-versus-memory table: every cache format of the paper's comparison scored on the held-out
tasks through the cache (see `loops`), with its exact storage cost.

The rows are the scheme catalog's (`rq_jax.cache.schemes.table_schemes`, and `calibrated_schemes` for
the rotation comparison, fitted by `rq_jax.calibrate.fit_rotations`); `evaluate(...)` fills one row.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from rq_jax import scoring
from rq_jax.cache import CacheCalib, cache_bytes
from rq_jax.cache.kv_error import dense_kv, reconstruction_error
from rq_jax.cache.schemes import Scheme
from rq_jax.calibrate.scheme import scheme_calibration
from rq_jax.data import StdlibText, Tasks, collate


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
    stored = cache_bytes(model.config, scheme.fmt, tasks.length, num_loops=scorer.num_loops)
    row["bytes_per_token"], row["bits_per_element"] = stored.per_token, float(stored.bits_per_element)
    return row


def run_table(model, schemes: Sequence[Scheme], tasks: Tasks, *, num_loops: int, batch: int, mesh=None,
              calibration: str | None = None, fit_rows: int = 32, done: dict[str, dict] | None = None,
              show_progress: bool = True, on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every scheme's row (`evaluate`), in order, with its calibration (`scheme_calibration`: the artifact
    of its method under `calibration`, else fitted on `fit_rows` rows; recorded as the row's
    "calibration") and its seconds. A row whose label is in `done` (an earlier run's) is kept as it was.
    `on_row(rows so far)` after each row (e.g. a resumable write). A progress bar counts answers as
    their batches finish; without it (`show_progress=False`) one line per scored row goes to stderr.
    Raises `rq_jax.calibrate.scheme.NeedsCalibration` for a row whose artifact is missing."""
    bar = tqdm(total=tasks.num_answers() * len(schemes), disable=not show_progress, desc="eval", unit="answer")

    def progress(status: str, answers: int) -> None:
        bar.set_postfix_str(status, refresh=False)
        bar.update(answers)

    rows = []
    for scheme in schemes:
        if done and scheme.label in done:
            rows.append(done[scheme.label])
            progress(f"{scheme.label}: resumed", tasks.num_answers())
            continue
        start = time.perf_counter()
        if scheme.method:
            progress(f"{scheme.label}: calibrating", 0)
        calib, source = scheme_calibration(scheme, model, num_loops, folder=calibration, rows=fit_rows)
        r = evaluate(model, scheme, tasks, batch=batch, calib=calib, mesh=mesh, num_loops=num_loops,
                     progress=progress)
        rows.append({**r, **({"calibration": source} if source else {}), "seconds": time.perf_counter() - start})
        if not show_progress:
            print(f"eval: {scheme.label}: addition {100 * r['addition']['accuracy']:.1f}%, retrieval "
                  f"{100 * r['retrieval']['accuracy']:.1f}%, {r['text']['bpb']:.3f} bpb, {rows[-1]['seconds']:.0f} s",
                  file=sys.stderr, flush=True)
        on_row(rows)
    bar.close()
    return rows


def loop_kv_error(model, scheme: Scheme, tasks: Tasks, num_loops: int, examples: int = 8) -> dict:
    """K/V reconstruction error of `scheme`'s format per loop and layer on `examples` held-out retrieval
    prompts (`rq_jax.cache.kv_error.reconstruction_error`, as lists): the figure's map."""
    rows = tasks.retrieval.examples("eval", examples, tasks.seed, num_pairs=tasks.retrieval_pairs)
    prompts = collate(rows, tasks.retrieval.max_length(tasks.retrieval_pairs))[0]
    k, v = dense_kv(model, jnp.asarray(prompts), num_loops)
    err = reconstruction_error(scheme.fmt, k, v)
    return {"scheme": scheme.label, **{name: np.asarray(x).tolist() for name, x in err.items()}}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (bits, accuracy) points that no point with as few bits or fewer matches, in order of bits:
    the best accuracy reachable at each storage cost (the accuracy figures draw it)."""
    front = []
    for bits, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or acc > front[-1][1]:
            front.append((bits, acc))
    return front
