"""Key–value retrieval (multi-query associative recall): random pairs, then queries answered by their values.

    context  "q5;B1;…;m9;\n"        num_pairs pairs, each a key, its value and ";" (3 bytes)
    queries  "B" → "1", ";"   "m" → "9", ";"  …  num_queries distinct keys of the context, random order

Keys are distinct letters (a–z, A–Z), values random digits; 43 pairs and 43 queries make 259 tokens.
Each value follows its key directly, in the context and in the queries alike, so recall is the
induction-head pattern ("find the earlier copy of this token, read what came next") — the layout of
Zoology's MQAR task. One-token keys and values keep each answer a single exact lookup that a perturbed
cache breaks (a second value token needs a second, slower-forming circuit: 2-digit values stalled near
75% on their second digit in our probes). The curriculum is `max_pairs`: each example draws its pair
count uniformly in min_pairs..max_pairs; `mixture.retrieval_max_pairs(step)` grows it during training
up to `Retrieval.max_pairs`.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from rq_jax.data.common import Example, sample_in_split, stream_rng

_LETTERS = np.frombuffer(string.ascii_letters.encode(), np.uint8)
_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)


@dataclasses.dataclass(frozen=True)
class Retrieval:
    """Retrieval examples of at most `max_length(max_pairs)` tokens."""

    max_pairs: int = 43
    min_pairs: int = 2
    num_queries: int = 43
    key_len: int = 1
    value_len: int = 1

    def __post_init__(self):
        if not 1 <= self.min_pairs <= self.max_pairs <= len(_LETTERS) ** self.key_len:
            raise ValueError(f"need 1 <= min_pairs <= max_pairs <= {len(_LETTERS) ** self.key_len} distinct "
                             f"{self.key_len}-letter keys, got {self.min_pairs}..{self.max_pairs}")

    def max_length(self, num_pairs: int | None = None) -> int:
        """Tokens in an example with `num_pairs` pairs (default max_pairs)."""
        n = self.max_pairs if num_pairs is None else num_pairs
        pair = self.key_len + self.value_len + 1
        return n * pair + 1 + min(self.num_queries, n) * pair

    def draw(self, rng: np.random.Generator, max_pairs: int | None = None, num_pairs: int | None = None) -> Example:
        """One example, split unchecked, with `num_pairs` pairs (default uniform in min_pairs..max_pairs)."""
        hi = self.max_pairs if max_pairs is None else max(self.min_pairs, min(max_pairs, self.max_pairs))
        n = int(rng.integers(self.min_pairs, hi + 1)) if num_pairs is None else num_pairs
        keys: list[bytes] = []
        seen = set()
        while len(keys) < n:
            k = _LETTERS[rng.integers(0, len(_LETTERS), self.key_len)].tobytes()
            if k not in seen:
                seen.add(k)
                keys.append(k)
        values = [_DIGITS[rng.integers(0, 10, self.value_len)].tobytes() for _ in range(n)]
        context = b"".join(k + v + b";" for k, v in zip(keys, values)) + b"\n"
        segments = [(context, False)]
        for q in rng.permutation(n)[: min(self.num_queries, n)]:
            segments += [(keys[q], False), (values[q], True), (b";", False)]
        return Example.from_segments("retrieval", segments)

    def sample(self, rng: np.random.Generator, split: str, max_pairs: int | None = None,
               num_pairs: int | None = None) -> Example:
        """One example of `split` (see `draw`)."""
        return sample_in_split(lambda r: self.draw(r, max_pairs, num_pairs), rng, split)

    def examples(self, split: str, n: int, seed: int = 0, num_pairs: int | None = None) -> list[Example]:
        """The first `n` examples of `split`'s fixed stream, all with `num_pairs` pairs when given
        (else uniform in min_pairs..max_pairs). Example i uses `stream_rng(seed, split, 1, i)`."""
        return [self.sample(stream_rng(seed, split, 1, i), split, num_pairs=num_pairs) for i in range(n)]
