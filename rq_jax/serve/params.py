"""What a request asks of the engine: its sampling parameters, checked when they are built (`ParamError` names
the parameter, which the API answers with a 400 naming the field)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from rq_jax.serve.programs import TOP_LOGPROBS


class ParamError(ValueError):
    """A request parameter that cannot be served; `param` names it (the API's 400 `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is generated. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    `stop` strings end the text before them; `stop_token_ids` add to the engine's eos ids (the token
    is counted, its text is not part of the output), which `ignore_eos` leaves out. `seed` seeds the
    request's PRNG chain (the Sampler's `seed`: sampling, and Huginn's random initial state).
    `logprobs` alternatives (0 to `TOP_LOGPROBS`) are reported per token beside the chosen token's own
    log-probability; `prompt_logprobs` adds the prompt's (the API's `echo`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: bool = False

    def __post_init__(self):
        def need(ok: bool, param: str, what: str):
            if not ok:
                raise ParamError(param, f"{param} must be {what}, got {getattr(self, param)!r}")

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer ≥ 1")
        need(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature", "a finite number ≥ 0")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer ≥ 0 (0: off)")
        need(_is_int(self.seed) and 0 <= self.seed < 2**31, "seed", "an integer in [0, 2^31)")
        need(_is_int(self.logprobs) and 0 <= self.logprobs <= TOP_LOGPROBS, "logprobs",
             f"an integer in [0, {TOP_LOGPROBS}]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "integers")


def check_request(prompt: Sequence[int], params: SamplingParams, vocab: int, max_len: int) -> None:
    """Raise ParamError when a request cannot be served by an engine of `vocab` token ids and rows of `max_len`
    positions: an empty prompt, token ids outside the vocabulary, or a prompt plus max_tokens longer than
    `max_len`."""
    if len(prompt) == 0:
        raise ParamError("prompt", "the prompt is empty: it needs at least one token")
    bad = sorted({int(t) for t in prompt if not 0 <= int(t) < vocab})
    if bad:
        raise ParamError("prompt", f"prompt token ids must lie in [0, {vocab}), got {bad[:5]}")
    bad = sorted({int(t) for t in params.stop_token_ids if not 0 <= int(t) < vocab})
    if bad:
        raise ParamError("stop_token_ids", f"stop token ids must lie in [0, {vocab}), got {bad[:5]}")
    need = len(prompt) + params.max_tokens - 1  # the last token is never fed back
    if need > max_len:
        raise ParamError("max_tokens", f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} "
                         f"needs {need} cache positions, but a request holds {max_len}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
