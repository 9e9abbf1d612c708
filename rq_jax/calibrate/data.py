"""Calibration sequences: the data generators' "calib" split, cut into a fit part and a holdout part.

Calibration data never meets evaluation data: every example comes from `rq_jax.data`'s "calib" split
(addition and retrieval examples whose key hashes into the calib bucket, stdlib text of
`CALIB_MODULES`), which is disjoint from "eval" by construction. Inside it, fit and holdout are
disjoint by construction too: an example belongs to the part its key hashes to (`part_of`), and text
windows alternate (even windows fit, odd windows holdout).

Rows are fixed-length, like the training rows: addition and retrieval rows pack whole examples back to
back and pad the tail with EOS; text rows are windows. Row i of a part has task `tasks[i % len(tasks)]`.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

import numpy as np

from rq_jax.data import EOS, TASKS, Addition, Example, Retrieval, StdlibText, encode, split_of, stream_rng

PARTS = ("fit", "holdout")
_STREAM = 40  # seed-stream id of calibration rows (training uses 9, the task example streams 0 and 1)


def part_of(key: bytes) -> str:
    """The calibration part ("fit" or "holdout") that owns a calib-split example with key `key`."""
    digest = hashlib.blake2b(b"rq_jax.calibrate.part:" + key, digest_size=8).digest()
    return PARTS[int.from_bytes(digest, "little") % 2]


class CalibrationSet(NamedTuple):
    """Calibration rows [N, T] int32, which of their tokens are answers [N, T] bool (the answer tokens of
    packed addition and retrieval examples; none in text rows) and, per row, where its tokens came from:
    the keys of the packed examples or `(b"text", start)` for a window of the calib text."""

    tokens: np.ndarray
    answers: np.ndarray
    sources: tuple[tuple, ...]
    info: dict


def _draw(task: str, rng: np.random.Generator, part: str, seq_len: int, max_tries: int = 10_000) -> Example:
    """One example of `task` in the calib split and in `part`."""
    if task == "addition":
        draw = Addition().draw
    else:
        ret = Retrieval()
        pairs = max(n for n in range(ret.min_pairs, ret.max_pairs + 1) if ret.max_length(n) <= seq_len)
        def draw(g):
            return ret.draw(g, max_pairs=pairs)
    for _ in range(max_tries):
        ex = draw(rng)
        if split_of(ex.key) == "calib" and part_of(ex.key) == part:
            return ex
    raise RuntimeError(f"no calib/{part} {task} example in {max_tries} draws")


def _packed(task: str, part: str, row: int, seq_len: int,
            seed: int) -> tuple[np.ndarray, np.ndarray, tuple[bytes, ...]]:
    """Whole examples back to back until the next does not fit; the tail EOS. Returns the tokens [T],
    the answer mask [T] and the examples' keys."""
    rng = stream_rng(seed, "calib", _STREAM, TASKS.index(task), PARTS.index(part), row)
    tokens = np.full(seq_len, EOS, np.int32)
    answers = np.zeros(seq_len, bool)
    keys, pos = [], 0
    while True:
        ex = _draw(task, rng, part, seq_len)
        if pos + len(ex) > seq_len:
            break
        tokens[pos : pos + len(ex)] = ex.tokens
        answers[pos : pos + len(ex)] = ex.answer_id > 0
        keys.append(ex.key)
        pos += len(ex)
    return tokens, answers, tuple(keys)


def calibration_set(part: str, n: int, seq_len: int, *, seed: int = 0, tasks: Sequence[str] = TASKS,
                    text: StdlibText | None = None) -> CalibrationSet:
    """`n` calibration rows of `seq_len` tokens from the calib split's `part` ("fit" or "holdout")."""
    if part not in PARTS:
        raise ValueError(f"unknown calibration part {part!r}: expected one of {PARTS}")
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"calibration tasks must be a non-empty subset of {TASKS}, got {list(tasks)}")
    if "retrieval" in tasks and seq_len < Retrieval().max_length(Retrieval().min_pairs):
        raise ValueError(f"seq_len {seq_len} is too short for a retrieval example "
                         f"({Retrieval().max_length(Retrieval().min_pairs)} tokens)")
    kinds = [tasks[i % len(tasks)] for i in range(n)]
    windows = None
    if "text" in kinds:
        text = text if text is not None else StdlibText()
        data = text.tokens("calib")
        own = np.arange(PARTS.index(part), len(data) // seq_len, 2)  # even windows fit, odd holdout
        count = kinds.count("text")
        if count > len(own):
            raise ValueError(f"the calib text has {len(own)} {part} windows of {seq_len} tokens, asked for {count}")
        windows = own[(np.arange(count) * len(own)) // count] * seq_len
    rows, answers, sources, seen = [], [], [], {}
    for i, task in enumerate(kinds):
        j = seen[task] = seen.get(task, -1) + 1
        if task == "text":
            start = int(windows[j])
            rows.append(data[start : start + seq_len].astype(np.int32))
            answers.append(np.zeros(seq_len, bool))
            sources.append((b"text", start))
        else:
            tokens, mask, keys = _packed(task, part, j, seq_len, seed)
            rows.append(tokens)
            answers.append(mask)
            sources.append(keys)
    info = dict(source="rq_jax.data calib split", part=part, rows=n, seq_len=seq_len, seed=seed,
                tasks=list(tasks))
    if text is not None:
        info.update(python_version=text.python_version, text_modules=text.modules["calib"])
    if not rows:
        return CalibrationSet(np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), bool), (), info)
    return CalibrationSet(np.stack(rows), np.stack(answers), tuple(sources), info)


def reads_calibration_data(vocab_size: int, tokenizer=None) -> str | None:
    """Why a model cannot read the calibration rows (byte-level token ids 0..258, `rq_jax.data.encode`),
    or None when it can: its vocabulary must hold them and its tokenizer (when it has one) must write a
    sample the same way."""
    if vocab_size < 259:
        return (f"the calibration data are byte-level token ids (0..258) but the model's vocabulary has "
                f"{vocab_size} entries")
    sample = "def f(x):\n    return x + 1  # é"
    if tokenizer is not None and tokenizer.encode(sample).ids != encode(sample).tolist():
        return "its tokenizer is not the byte-level one the calibration data are written in"
    return None
