"""The training stream: each batch a fixed mixture of addition, retrieval and stdlib-text rows.

`Mixture.batch(step)` is a pure function of (config, step): row r of step s is generated from
`stream_rng(seed, "train", 9, s, r)`, so a run resumes at any step by asking for that step's batch —
no iterator state to save. Addition and retrieval rows pack whole examples (answer tokens get loss
weight 1, prompts `prompt_weight`); text rows are windows of the training modules (weight 1).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

import numpy as np

from rq_jax.data.addition import Addition
from rq_jax.data.common import EOS, TASKS, stream_rng
from rq_jax.data.retrieval import Retrieval
from rq_jax.data.text import StdlibText


class Batch(NamedTuple):
    """A training batch. Inputs are tokens[:, :-1], targets tokens[:, 1:]."""

    tokens: np.ndarray  # [B, L + 1] int32
    weights: np.ndarray  # [B, L] float32: loss weight of predicting tokens[:, 1:]
    task: np.ndarray  # [B] int32, index into TASKS
    step: int


@dataclasses.dataclass(frozen=True)
class MixtureConfig:
    """Rows per task in each batch (`rows`, in TASKS order), sequence length and the curriculum."""

    seq_len: int = 258  # rows hold seq_len + 1 tokens (inputs and shifted targets)
    rows: tuple[int, int, int] = (2, 6, 1)
    seed: int = 0
    addition: Addition = Addition()
    retrieval: Retrieval = Retrieval()
    prompt_weight: float = 0.0
    #: retrieval's max pair count grows linearly from `curriculum_start` to retrieval.max_pairs over
    #: `curriculum_steps` steps.
    curriculum_start: int = 4
    curriculum_steps: int = 3000

    @property
    def batch_size(self) -> int:
        return sum(self.rows)

    def __post_init__(self):
        if len(self.rows) != len(TASKS):
            raise ValueError(f"rows must give one count per task {TASKS}, got {self.rows}")
        if self.retrieval.max_length() > self.seq_len + 1:
            raise ValueError(f"seq_len {self.seq_len} too short for {self.retrieval.max_pairs} retrieval pairs "
                             f"({self.retrieval.max_length()} tokens)")

    @classmethod
    def from_json(cls, raw: dict) -> "MixtureConfig":
        """The config `dataclasses.asdict` wrote (a checkpoint card's `train_config.data`)."""
        raw = dict(raw)
        return cls(**{**raw, "addition": Addition(**raw["addition"]), "retrieval": Retrieval(**raw["retrieval"]),
                      "rows": tuple(raw["rows"])})

    def retrieval_max_pairs(self, step: int) -> int:
        """The curriculum: retrieval's max pair count at `step`."""
        frac = min(1.0, step / max(1, self.curriculum_steps))
        lo, hi = min(self.curriculum_start, self.retrieval.max_pairs), self.retrieval.max_pairs
        return int(round(lo + frac * (hi - lo)))


class Mixture:
    """Deterministic, random-access batches of the training split (see the module docstring)."""

    def __init__(self, config: MixtureConfig, text: StdlibText | None = None):
        self.config = config
        self.text = text if text is not None else StdlibText()

    def _packed_row(self, draw, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole examples from `draw(rng)` back to back until the next does not fit; EOS-padded."""
        c = self.config
        tokens = np.full(length, EOS, np.int32)
        weights = np.zeros(length, np.float32)
        pos = 0
        while True:
            ex = draw(rng)
            if pos + len(ex) > length:
                break
            tokens[pos : pos + len(ex)] = ex.tokens
            weights[pos : pos + len(ex)] = np.where(ex.answer_id > 0, 1.0, c.prompt_weight)
            pos += len(ex)
        return tokens, weights

    def row(self, step: int, r: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Row r of step `step`: tokens [L + 1], per-token weights [L + 1] (of predicting that token),
        and its task index."""
        c = self.config
        task = int(np.searchsorted(np.cumsum(c.rows), r, side="right"))
        rng = stream_rng(c.seed, "train", 9, step, r)
        length = c.seq_len + 1
        if TASKS[task] == "addition":
            tokens, weights = self._packed_row(lambda g: c.addition.sample(g, "train"), rng, length)
        elif TASKS[task] == "retrieval":
            max_pairs = c.retrieval_max_pairs(step)
            tokens, weights = self._packed_row(lambda g: c.retrieval.sample(g, "train", max_pairs), rng, length)
        else:
            tokens, weights = self.text.window(rng, length, "train"), np.ones(length, np.float32)
        return tokens, weights, task

    def batch(self, step: int) -> Batch:
        """The batch of training step `step` (0-based)."""
        rows = [self.row(step, r) for r in range(self.config.batch_size)]
        tokens = np.stack([t for t, _, _ in rows])
        weights = np.stack([w for _, w, _ in rows])[:, 1:]
        return Batch(tokens, weights, np.array([k for _, _, k in rows], np.int32), step)

    def stream(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches of steps start, start + 1, … (resume a run by passing its next step)."""
        step = start
        while stop is None or step < stop:
            yield self.batch(step)
            step += 1
