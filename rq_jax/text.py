"""Text in, text out: a checkpoint's model, tokenizer and stop ids around a `Sampler`.

    from rq_jax import generate
    generate("62217+89000=")                        # '423170': the shipped Huginn's answer, 71226 + 98 reversed

    from rq_jax import TextGenerator
    gen = TextGenerator("checkpoints/ouro-small", cache="residual", max_new_tokens=8)
    gen(["62217+89000=", "00001+00002="])           # one compiled program per batch shape, reused
    gen.last                                         # the `Generation` behind the last call (tokens, cache, timings)
"""

from __future__ import annotations

import os
from typing import Sequence

import jax.numpy as jnp

from rq_jax import checkpoint
from rq_jax.cache import get_format
from rq_jax.sampling import Generation, Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer, stop_token_ids

#: The checkpoint `generate` runs by default: the shipped small Huginn (trained on reversed-digit sums,
#: key–value retrieval and Python source; see its README.md).
DEFAULT = os.path.join(checkpoint.SHIPPED, "huginn-small")


class TextGenerator:
    """Generate text from a checkpoint (folder or cached hub id) through a `cache` format (policy
    keywords in `policy`, e.g. `bits=(2, 2, 2, 4)`), stopping at the checkpoint's stop ids
    (`rq_jax.tokenizer.stop_token_ids`: its tokenizer's end-of-turn tokens and generation_config.json's
    eos ids). `num_loops` (None: the config's) and, for Huginn, `init_scale` (1: a random initial state
    seeded by the call's seed, 0: zeros) go to every model call; sampling as `SamplingConfig`."""

    def __init__(self, source: str | os.PathLike = DEFAULT, cache: str = "residual", *, max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, num_loops: int | None = None,
                 init_scale: float = 1.0, dtype=jnp.float32, **policy):
        self.model, self.folder = checkpoint.load(source, dtype=dtype)
        self.tokenizer = load_tokenizer(self.folder)
        self.stop_tokens = stop_token_ids(self.tokenizer, self.folder)
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  stop_tokens=self.stop_tokens)
        kwargs = dict(num_loops=num_loops)
        if self.model.config.family == "huginn":
            kwargs["init_scale"] = init_scale
        self.sampler = Sampler(self.model, sampling, get_format(cache, **policy), **kwargs)
        self.last: Generation | None = None

    def __call__(self, text: str | Sequence[str], *, seed: int = 0) -> str | list[str]:
        """The completion of `text` (or of each text of a list, generated as one batch), up to and
        without the stop token that ended it."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(texts):
            raise ValueError("every prompt needs at least one character")
        self.last = self.sampler([self.tokenizer.encode(t).ids for t in texts], seed=seed)
        out = []
        for row, n in zip(self.last.tokens, self.last.num_generated):
            ids = row[: int(n)].tolist()
            if ids and ids[-1] in self.stop_tokens:
                ids = ids[:-1]
            out.append(self.tokenizer.decode(ids))
        return out[0] if isinstance(text, str) else out


def generate(text: str | Sequence[str], source: str | os.PathLike = DEFAULT, cache: str = "residual",
             **options) -> str | list[str]:
    """One call: load `source` (default the shipped Huginn) into a `TextGenerator` with `options` and
    return its completion of `text`. Loads and compiles every time; keep a `TextGenerator` to reuse."""
    return TextGenerator(source, cache, **options)(text)
