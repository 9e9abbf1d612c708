"""Serving: a continuous-batching engine over the compressed KV cache (`engine`), its compiled pieces
(`programs`), and an OpenAI-compatible HTTP server (`api`)."""

from rq_jax.serve.engine import Completion, Delta, Engine, ParamError, SamplingParams, TokenLogprob

__all__ = ["Completion", "Delta", "Engine", "ParamError", "SamplingParams", "TokenLogprob"]
