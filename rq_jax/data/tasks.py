"""The held-out evaluation sets every accuracy figure is measured on: the eval split of the generated
tasks (addition, retrieval) and stdlib text windows (`Tasks`)."""

from __future__ import annotations

import dataclasses

from rq_jax.data.addition import Addition
from rq_jax.data.retrieval import Retrieval


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
