"""Tokenizers: load a checkpoint's `tokenizer.json`, or build the byte-level one our small models use."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: ids 0..2 are `SPECIAL_TOKENS`, then the 256 bytes in the
    order of their printable stand-in characters (so byte b is not id 3 + b: encode with the tokenizer,
    or `rq_jax.data.encode`, which follows the same order)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The `tokenizer.json` in a checkpoint folder."""
    path = os.path.join(os.fspath(folder), "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return Tokenizer.from_file(path)
