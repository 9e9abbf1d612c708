"""What every task shares: byte-level token ids, examples with answer spans, seeded streams, split hashing.

Tokens are ids of `rq_jax.tokenizer.byte_level_tokenizer()`: 0..2 are the special tokens
(`EOS` = 0 = <|endoftext|>, also used as padding), 3..258 the 256 bytes in the tokenizer's order
(GPT-2 byte-to-unicode characters, sorted), so `encode` is exactly `tokenizer.encode(text).ids`.

Splits never overlap *by construction*: every generated example has a canonical key (its bytes), and
`split_of(key)` assigns it to exactly one split by a hash bucket; a stream for split s keeps only
examples whose bucket is s (rejection sampling). The streams are also seeded apart (`stream_rng`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Sequence

import numpy as np

from rq_jax.tokenizer import byte_level_tokenizer

EOS = 0  # <|endoftext|>: separator between documents and padding (never a loss target when padding)
BYTE_OFFSET = 3  # ids 0..2 are the special tokens; every id ≥ 3 is one byte

SPLITS = ("train", "calib", "eval")
#: Hash buckets out of 1000 per split: train [0, 900), calib [900, 950), eval [950, 1000).
SPLIT_BUCKETS = {"train": (0, 900), "calib": (900, 950), "eval": (950, 1000)}
#: Seed-stream ids (the second entry of every seed sequence), one per split.
STREAM_IDS = {"train": 1, "calib": 2, "eval": 3}
TASKS = ("addition", "retrieval", "text")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what `pre_tokenizers.ByteLevel` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def byte_tables() -> tuple[np.ndarray, np.ndarray]:
    """(byte → token id [256] int32, token id → byte [259] int32 with −1 for special tokens)."""
    vocab = byte_level_tokenizer().get_vocab()
    to_id = np.array([vocab[ch] for _, ch in sorted(_bytes_to_unicode().items())], np.int32)
    to_byte = np.full(len(vocab), -1, np.int32)
    to_byte[to_id] = np.arange(256)
    if sorted(to_id.tolist()) != list(range(BYTE_OFFSET, BYTE_OFFSET + 256)):
        raise AssertionError("byte-level tokenizer does not map the 256 bytes to ids 3..258")
    return to_id, to_byte


def encode(data: bytes | str) -> np.ndarray:
    """Bytes (or UTF-8 text) → token ids [T] int32 (as `byte_level_tokenizer().encode(text).ids`)."""
    if isinstance(data, str):
        data = data.encode()
    return byte_tables()[0][np.frombuffer(data, np.uint8)]


def decode(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids → bytes; special tokens are dropped."""
    ids = np.asarray(ids, np.int64)
    return bytes(byte_tables()[1][ids[ids >= BYTE_OFFSET]].astype(np.uint8).tolist())


def split_of(key: bytes) -> str:
    """The split ("train", "calib" or "eval") that owns an example with canonical key `key`."""
    bucket = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 1000
    for name, (lo, hi) in SPLIT_BUCKETS.items():
        if lo <= bucket < hi:
            return name
    raise AssertionError(bucket)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
    return split


def stream_rng(seed: int, split: str, *index: int) -> np.random.Generator:
    """The generator for item `index` (e.g. (step, row) or (example,)) of split `split`'s stream.

    Random access: any item is reproducible from (seed, split, index) alone.
    """
    return np.random.default_rng([int(seed), STREAM_IDS[check_split(split)], *map(int, index)])


@dataclasses.dataclass(frozen=True)
class Example:
    """One example: token ids [T] and answer ids [T] (0 = prompt, k ≥ 1 = the k-th answer's tokens).

    Training can weight the loss on answer tokens only; evaluation scores each answer by exact match
    (every answer token predicted from the tokens before it). `key` is the canonical bytes that decide
    the example's split.
    """

    task: str
    tokens: np.ndarray  # [T] int32
    answer_id: np.ndarray  # [T] int32
    key: bytes

    @classmethod
    def from_segments(cls, task: str, segments: Sequence[tuple[bytes, bool]], key: bytes | None = None) -> "Example":
        """Build from (bytes, is_answer) segments in order; answers are numbered 1, 2, … as they come."""
        toks, ids, k = [], [], 0
        for data, is_answer in segments:
            t = encode(data)
            k += bool(is_answer)
            toks.append(t)
            ids.append(np.full(len(t), k if is_answer else 0, np.int32))
        tokens = np.concatenate(toks).astype(np.int32)
        key = key if key is not None else b"".join(s for s, _ in segments)
        return cls(task, tokens, np.concatenate(ids), key)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_answers(self) -> int:
        return int(self.answer_id.max(initial=0))

    def prompt(self, k: int = 1) -> np.ndarray:
        """Tokens before answer k [P] (earlier answers included, as teacher forcing sees them)."""
        return self.tokens[: int(np.argmax(self.answer_id == k))]

    def answer(self, k: int = 1) -> np.ndarray:
        """Tokens of answer k [A]."""
        return self.tokens[self.answer_id == k]

    @property
    def text(self) -> bytes:
        return decode(self.tokens)


def sample_in_split(draw, rng: np.random.Generator, split: str, max_tries: int = 10_000) -> Example:
    """Call `draw(rng)` until the example it returns belongs to `split` (rejection sampling)."""
    check_split(split)
    for _ in range(max_tries):
        ex = draw(rng)
        if split_of(ex.key) == split:
            return ex
    raise RuntimeError(f"no {split} example in {max_tries} draws")


def collate(examples: Sequence[Example], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad examples (each alone in its row) to `length`: tokens [N, length] int32 (EOS padding) and
    answer_id [N, length] int32. Raises ValueError if one is longer."""
    tokens = np.full((len(examples), length), EOS, np.int32)
    answer_id = np.zeros((len(examples), length), np.int32)
    for i, ex in enumerate(examples):
        if len(ex) > length:
            raise ValueError(f"{ex.task} example of {len(ex)} tokens does not fit in {length}")
        tokens[i, : len(ex)] = ex.tokens
        answer_id[i, : len(ex)] = ex.answer_id
    return tokens, answer_id
