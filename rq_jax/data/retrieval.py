"""Key–value retrieval: a list of random pairs, then several queries, each answered by its value.

    context  "qzk:583;abf:017;…;mwe:902;\n"       num_pairs pairs, 8 bytes each (32 pairs = 256 bytes)
    queries  "abf?" → "017\n"   "mwe?" → "902\n"  …  num_queries distinct keys from the context

Keys are distinct 3-letter strings, values 3 random digits. The curriculum is `max_pairs`: each example
draws its pair count uniformly in min_pairs..max_pairs; `mixture.retrieval_max_pairs(step)` grows it
during training up to `Retrieval.max_pairs`.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from rq_jax.data.common import Example, sample_in_split, stream_rng

_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), np.uint8)
_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)


@dataclasses.dataclass(frozen=True)
class Retrieval:
    """Retrieval examples of at most `max_length(max_pairs)` tokens."""

    max_pairs: int = 32
    min_pairs: int = 2
    num_queries: int = 8
    key_len: int = 3
    value_len: int = 3

    def max_length(self, num_pairs: int | None = None) -> int:
        """Tokens in an example with `num_pairs` pairs (default max_pairs)."""
        n = self.max_pairs if num_pairs is None else num_pairs
        pair = self.key_len + self.value_len + 2
        return n * pair + 1 + min(self.num_queries, n) * pair

    def draw(self, rng: np.random.Generator, max_pairs: int | None = None, num_pairs: int | None = None) -> Example:
        """One example, split unchecked, with `num_pairs` pairs (default uniform in min_pairs..max_pairs)."""
        hi = self.max_pairs if max_pairs is None else max(self.min_pairs, min(max_pairs, self.max_pairs))
        n = int(rng.integers(self.min_pairs, hi + 1)) if num_pairs is None else num_pairs
        keys: list[bytes] = []
        seen = set()
        while len(keys) < n:
            k = _LETTERS[rng.integers(0, 26, self.key_len)].tobytes()
            if k not in seen:
                seen.add(k)
                keys.append(k)
        values = [_DIGITS[rng.integers(0, 10, self.value_len)].tobytes() for _ in range(n)]
        context = b"".join(k + b":" + v + b";" for k, v in zip(keys, values)) + b"\n"
        segments = [(context, False)]
        for q in rng.permutation(n)[: min(self.num_queries, n)]:
            segments += [(keys[q] + b"?", False), (values[q] + b"\n", True)]
        return Example.from_segments("retrieval", segments)

    def sample(self, rng: np.random.Generator, split: str, max_pairs: int | None = None,
               num_pairs: int | None = None) -> Example:
        """One example of `split` (see `draw`)."""
        return sample_in_split(lambda r: self.draw(r, max_pairs, num_pairs), rng, split)

    def examples(self, split: str, n: int, seed: int = 0, num_pairs: int | None = None) -> list[Example]:
        """The first `n` examples of `split`'s fixed stream, all with `num_pairs` pairs when given
        (else uniform in min_pairs..max_pairs). Example i uses `stream_rng(seed, split, 1, i)`."""
        return [self.sample(stream_rng(seed, split, 1, i), split, num_pairs=num_pairs) for i in range(n)]
