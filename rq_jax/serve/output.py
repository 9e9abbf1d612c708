"""The serving engine's output processor: what becomes of the tokens the model picks. Per request it keeps the
text so far (incremental detokenization, stop strings: `TextStream`), the tokens' log-probabilities, and its
latency metrics; it decides when a request is finished (a stop token, a stop string, `max_tokens`) and hands
each request's sink what is new (`Delta`s). No arrays, no pages: the scheduler and the model runner know
nothing of text, and this knows nothing of the cache.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.params import SamplingParams
from rq_jax.serve.text import TextStream

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the `logprobs` most likely alternatives (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request produced since its last delta: text, token ids, their log-probabilities; the
    finish reason on the last one (stop, length or cancelled); the prompt's log-probabilities (None for
    its first token) on the first one when asked for."""

    request_id: str
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its text, generated token ids (a stop token included), their log-probabilities,
    the finish reason, the prompt's ids and (when asked for) log-probabilities."""

    request_id: str
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str
    prompt: tuple[int, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None


@dataclasses.dataclass(eq=False)
class Request:
    """A request's state while the engine holds it (`seq`: the scheduler's id of it)."""

    id: str
    seq: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Delta], None] | None
    stops: frozenset[int]
    stream: TextStream
    arrival: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    last_time: float | None = None
    sent_tokens: int = 0


class OutputProcessor:
    """Turns picked tokens into text, finish decisions and deltas (the module docstring); `metrics` (a
    `ServeMetrics`) is kept up to date when given."""

    def __init__(self, metrics: ServeMetrics | None = None):
        self.metrics = metrics

    def token(self, request: Request, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> str | None:
        """Record a request's new token with its log-probability and alternatives; returns the finish reason its
        id brings ("stop": a stop token, "length": max_tokens), or None. Its text comes with `emit` (or
        `finish`), which the engine runs while the next step computes."""
        now = time.perf_counter()
        token = int(token)
        request.tokens.append(token)
        request.logprobs.append(TokenLogprob(token, float(logprob), tuple(top)[: request.params.logprobs]))
        if self.metrics is not None:
            self.metrics.generated_tokens.inc()
            if request.last_time is None:
                self.metrics.ttft.observe(now - request.arrival)
            else:
                self.metrics.itl.observe(now - request.last_time)
        request.last_time = now
        if token in request.stops:
            return "stop"
        if len(request.tokens) >= request.params.max_tokens:
            return "length"
        return None

    def emit(self, request: Request) -> str | None:
        """Decode the request's tokens recorded since its last delta and send it; returns "stop" when they
        complete a stop string (then nothing is sent: `finish` sends the last delta)."""
        if self._decode(request):
            return "stop"
        self.send(request)
        return None

    def finish(self, request: Request, reason: str) -> None:
        """End a request (one of `FINISH_REASONS`; "stop" when its undecoded tokens complete a stop string): its
        last delta, with everything held back."""
        if self._decode(request):
            reason = "stop"
        request.finish_reason = reason
        self.send(request)
        if self.metrics is not None:
            self.metrics.finished(reason)
            if request.last_time is not None:
                self.metrics.e2e.observe(time.perf_counter() - request.arrival)

    @staticmethod
    def _decode(request: Request) -> bool:
        """Feed the request's text stream the tokens it has not seen (a stop token, always the last, is no
        text); True when they complete a stop string."""
        for token in request.tokens[len(request.stream.ids):]:
            if token in request.stops:
                return False
            if request.stream.add(token):
                return True
        return False

    def send(self, request: Request) -> None:
        """Hand the request's sink what is new (everything on its last delta)."""
        final = request.finish_reason is not None
        text = request.stream.pending(final)
        new = slice(request.sent_tokens, len(request.tokens))
        if request.sink is not None and (text or final or new.start < new.stop):
            first = request.sent_tokens == 0 and request.prompt_logprobs is not None
            request.sink(Delta(request.id, text, tuple(request.tokens[new]), tuple(request.logprobs[new]),
                               request.finish_reason, tuple(request.prompt_logprobs) if first else None))
        request.sent_tokens = len(request.tokens)


def completion(request: Request, deltas: Sequence[Delta]) -> Completion:
    """A finished request's `Completion`, from the deltas its sink received."""
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return Completion(request.id, "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.tokens),
                      tuple(lp for d in deltas for lp in d.logprobs), request.finish_reason, tuple(request.prompt),
                      prompt_logprobs)
