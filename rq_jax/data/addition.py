"""Multi-digit addition written least significant digit first, operands and answer alike.

    prompt  "32100+76540="        123 and 4567 zero-padded to `max_digits`, each reversed
    answer  "096400\n"            (123 + 4567 = 4690 → "004690" reversed), then "\n"

Padding to a fixed width puts every answer digit at a fixed offset from the operand digits it depends
on, and writing everything least significant first lets the carry flow in generation order: a layout
small transformers learn (with the operands most-significant first, a 4-loop model trained 300 steps
stayed near chance where this one reached 92% exact match).
Operand lengths are drawn uniformly in 1..max_digits (a built-in curriculum of easy and hard sums).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from rq_jax.data.common import Example, decode, sample_in_split, stream_rng


@dataclasses.dataclass(frozen=True)
class Addition:
    """Addition examples: prompt of 2·max_digits + 2 tokens, answer of max_digits + 2 tokens."""

    max_digits: int = 5

    @property
    def length(self) -> int:
        """Tokens per example."""
        return 2 * self.max_digits + 2 + self.max_digits + 2

    def make(self, a: int, b: int) -> Example:
        """The example for a + b (its key is "a+b", which decides its split)."""
        d = self.max_digits
        if not (0 <= a < 10**d and 0 <= b < 10**d):
            raise ValueError(f"operands must have at most {d} digits, got {a} and {b}")
        prompt = f"{a:0{d}d}"[::-1].encode() + b"+" + f"{b:0{d}d}"[::-1].encode() + b"="
        answer = f"{a + b:0{d + 1}d}"[::-1].encode() + b"\n"
        return Example.from_segments("addition", [(prompt, False), (answer, True)], key=b"add:%d+%d" % (a, b))

    def parse(self, prompt: str) -> tuple[int, int] | None:
        """The operands of a prompt in this format ("62217+89000=" → (71226, 98)), or None."""
        d = self.max_digits
        match = re.fullmatch(rf"(\d{{{d}}})\+(\d{{{d}}})=", prompt)
        return None if match is None else (int(match[1][::-1]), int(match[2][::-1]))

    def read(self, answer: str) -> int | None:
        """The sum an answer spells ("423170\n" → 71324): its first max_digits + 1 characters read least
        significant digit first; None when they are not all digits."""
        digits = answer[: self.max_digits + 1]
        return int(digits[::-1]) if len(digits) == self.max_digits + 1 and digits.isdigit() else None

    def check(self, prompt: str, text: str) -> str:
        """One line on a generation: for a prompt in this format, the sum read the usual way and whether
        the model's answer `text` spells it; for any other prompt, a note that the task is not a sum."""
        operands = self.parse(prompt)
        if operands is None:
            return ("note: this prompt is not a sum in the training format; the shipped models only know their "
                    "training tasks (sums as above, key-value retrieval, Python source), so expect text like that")
        (a, b), answer = operands, self.read(text)
        digits = self.max_digits + 1
        said = f"{text!r}, not {digits} digits" if answer is None else f"{text[:digits]} = {answer}"
        return f"check: {a} + {b} = {a + b}; the model answered {said}: {'right' if answer == a + b else 'wrong'}"

    def describe(self) -> str:
        """The format in one line, with the first held-out example."""
        d = self.max_digits
        ex = self.examples("eval", 1)[0]
        prompt, answer = decode(ex.prompt()).decode(), decode(ex.answer()).decode()
        a, b = self.parse(prompt)
        return (f"sums of {d}-digit operands (zero-padded), every number written least significant digit first: "
                f"{prompt!r} is {a} + {b}, answered {answer.strip()!r} = {a + b}")

    def draw(self, rng: np.random.Generator) -> Example:
        """One example, split unchecked: each operand's digit count uniform in 1..max_digits."""
        ops = []
        for _ in range(2):
            n = int(rng.integers(1, self.max_digits + 1))
            ops.append(int(rng.integers(0 if n == 1 else 10 ** (n - 1), 10**n)))
        return self.make(*ops)

    def sample(self, rng: np.random.Generator, split: str) -> Example:
        """One example of `split`."""
        return sample_in_split(self.draw, rng, split)

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        """The first `n` examples of `split`'s fixed stream (example i from `stream_rng(seed, split, i)`)."""
        return [self.sample(stream_rng(seed, split, 0, i), split) for i in range(n)]
