"""The accuracy-versus-memory table: every cache format of the paper's comparison scored on the held-out
tasks through the cache (see `loops`), with its exact storage cost.

`schemes(group_sizes)` lists the rows: dense; uniform INT2 and INT4; rotated INT2; kivi INT2; the
paper's ablation ladder at each group size g (direct INT2 → + residual with α = 1 → + least squares
→ + rotation → mixed [2,2,2,4]); residual_vq. `calibrated_schemes` adds the rotation comparison
(OSCAR, OptR-H against Hadamard), fitted by `fit_calibration`. `evaluate(...)` fills one row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


import numpy as np

from rq_jax.cache import CacheCalib, Dense, cache_nbytes, get_format, init_cache
from rq_jax.cache.base import CacheFormat
from rq_jax.data import Addition, Retrieval, StdlibText
from rq_jax.eval import loops


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A table row: its label, the format, the ladder it belongs to ("" for baselines), and the
    rotation's calibration method ("": the format's default rotation, Hadamard)."""

    label: str
    fmt: CacheFormat
    ladder: str = ""
    method: str = ""

    @property
    def rotated(self) -> bool:
        """Whether the format stores rotated K/V (so a calibrated rotation can replace its default)."""
        return getattr(self.fmt, "rotation", "identity") != "identity"


def schemes(group_sizes: Sequence[int] = (32, 16)) -> list[Scheme]:
    """The table's rows (see the module docstring). Baselines use the first group size."""
    g0 = group_sizes[0]
    rows = [Scheme("dense bf16", Dense("bfloat16")),
            Scheme("uniform INT4", get_format("uniform", bits=4, group_size=g0)),
            Scheme("rotated INT2", get_format("rotated", bits=2, group_size=g0)),
            Scheme("kivi INT2", get_format("kivi", bits=2)),
            Scheme("residual_vq", get_format("residual_vq"))]
    for g in group_sizes:
        ladder = f"g{g}"
        rows += [Scheme(f"direct INT2 g{g}", get_format("uniform", bits=2, group_size=g), ladder),
                 Scheme(f"+residual α=1 g{g}", get_format("residual", bits=(2, 2, 2, 2), group_size=g, least_squares=False,
                                                           rotation="identity"), ladder),
                 Scheme(f"+LS g{g}", get_format("residual", bits=(2, 2, 2, 2), group_size=g, rotation="identity"), ladder),
                 Scheme(f"+rotation g{g}", get_format("residual", bits=(2, 2, 2, 2), group_size=g), ladder),
                 Scheme(f"[2,2,2,4] g{g}", get_format("residual", group_size=g), ladder)]
    return rows


def calibrated_schemes(group_sizes: Sequence[int], methods: Sequence[str]) -> list[Scheme]:
    """Rows of the rotation comparison (issue 11): direct rotated INT2, residual INT2 and residual
    [2,2,2,4] at each group size, with each calibration `method` ("oscar", "optr-h") instead of the
    default Hadamard. OptR-H rows also fit key means (App. G.1)."""
    rows = []
    for method in methods:
        for g in group_sizes:
            means = dict(key_means=method == "optr-h")
            rows += [Scheme(f"rotated INT2 g{g} {method}", get_format("rotated", bits=2, group_size=g, **means),
                            f"g{g}", method),
                     Scheme(f"+rotation g{g} {method}", get_format("residual", bits=(2, 2, 2, 2), group_size=g, **means),
                            f"g{g}", method),
                     Scheme(f"[2,2,2,4] g{g} {method}", get_format("residual", group_size=g, **means), f"g{g}", method)]
    return rows


def fit_calibration(model, scheme: Scheme, num_loops: int, *, rows: int = 32, seq_len: int = 256, seed: int = 0,
                    progress: bool = False):
    """Fit `scheme.method` for the scheme's format on `rows` fit and `rows` holdout rows of the data's
    calib split (disjoint from the eval split). Returns (CacheCalib, summary of the per-head holdout
    losses: mean L_K and L_V before (Hadamard) and after, over every head and segment)."""
    from rq_jax.calibrate import OptRHConfig, calibrate_model, calibration_set

    fit = calibration_set("fit", rows, seq_len, seed=seed)
    holdout = calibration_set("holdout", rows, seq_len, seed=seed)
    cal = calibrate_model(model, scheme.fmt, fit.tokens, holdout.tokens, method=scheme.method, num_loops=num_loops,
                          config=OptRHConfig(seed=seed, key_means=scheme.fmt.key_means), seed=seed, progress=progress)
    segs = [seg for part in cal.report.values() for seg in part or ()]
    summary = {f"{kind}_{when}": float(np.mean([np.mean(seg[f"{kind}_{when}"]) for seg in segs]))
               for kind in ("key", "value") for when in ("before", "after")}
    return cal.calib, summary


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The held-out evaluation sets: `n` answers per generated task (eval split: `n` addition examples,
    `n` retrieval queries in ⌈n / queries⌉ sequences; each task's rows as long as its longest example), `text_windows` stdlib windows of `text_len` tokens scored after a
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

    def answer_sets(self) -> list[tuple[str, list, int]]:
        """(task, held-out examples, row length) of the answer tasks: `n` addition examples, and enough
        retrieval sequences for `n` queries (each query is one answer)."""
        queries = min(self.retrieval.num_queries, self.retrieval_pairs or self.retrieval.max_pairs)
        return [("addition", self.addition.examples("eval", self.n, self.seed), self.addition.length),
                ("retrieval", self.retrieval.examples("eval", -(-self.n // queries), self.seed,
                                                      num_pairs=self.retrieval_pairs),
                 self.retrieval.max_length(self.retrieval_pairs))]


def evaluate(model, scheme: Scheme, tasks: Tasks, *, batch: int = 32, text: StdlibText | None = None,
             calib: CacheCalib | None = None, mesh=None, progress: Callable[[str], None] = lambda _: None,
             **model_kwargs) -> dict:
    """One table row: per-task metrics of `loops.task_metrics` / `loops.text_metrics` through the
    scheme's cache (with `calib` when given, else the format's default), bits per element (the
    format's accounting at the row length) and bytes per token (the arrays of a cache of
    `tasks.length` positions, batch 1, all layers). `mesh`: see `loops.CacheScorer`."""
    scorer = loops.CacheScorer(model, scheme.fmt, calib=calib, seed=tasks.seed, mesh=mesh, **model_kwargs)
    row = {"scheme": scheme.label, "ladder": scheme.ladder, "method": scheme.method or "default"}
    for name, examples, length in tasks.answer_sets():
        progress(f"{scheme.label}: {name}")
        scores, _, answer_id = loops.score_examples(scorer, examples, length, batch)
        row[name] = loops.task_metrics(scores, answer_id)
    progress(f"{scheme.label}: text")
    text = text or StdlibText()
    windows = text.eval_windows(tasks.text_len, tasks.text_windows)
    row["text"] = loops.text_metrics(loops.score_windows(scorer, windows, tasks.text_prefix, batch))
    cache = init_cache(model.config, 1, tasks.length, scheme.fmt, num_loops=scorer.num_loops)
    row["bytes_per_token"] = cache_nbytes(cache) / tasks.length
    row["bits_per_element"] = float(bits_per_element(scheme.fmt, scorer.num_loops, model.config.head_dim, tasks.length))
    return row


def bits_per_element(fmt: CacheFormat, num_loops: int, head_dim: int, context_len: int):
    """The format's looped-layer bits per element (kivi's at `context_len` tokens)."""
    if fmt.name == "kivi":
        return fmt.bits_per_element(num_loops, head_dim, context_len=context_len)
    return fmt.bits_per_element(num_loops, head_dim)
