"""Serving: a continuous-batching engine over a paged compressed KV cache (`engine`: the `scheduler`, the
`model_runner` and its compiled `programs`, the `output` processor), and an OpenAI-compatible HTTP server
(`api`, run by `runner` and `launch`)."""

from rq_jax.serve.engine import Engine
from rq_jax.serve.output import Completion, Delta, TokenLogprob
from rq_jax.serve.params import ParamError, SamplingParams

__all__ = ["Completion", "Delta", "Engine", "ParamError", "SamplingParams", "TokenLogprob"]
