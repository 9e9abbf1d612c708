"""Tokenizers: load a checkpoint's `tokenizer.json`, or build the byte-level one our small models use; the
token ids that end a checkpoint's generations."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: End-of-turn texts whose token ids stop generation when a tokenizer has them.
STOP_STRINGS = ("<|endoftext|>", "<|end_text|>", "<|end_turn|>", "<|im_end|>")


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


def eos_ids(folder: str | os.PathLike) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: generation_config.json's `eos_token_id` (an id or a list)."""
    path = os.path.join(os.fspath(folder), "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def stop_token_ids(tokenizer: Tokenizer, folder: str | os.PathLike) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's `STOP_STRINGS` tokens, then the checkpoint's eos ids
    (the shipped models': end of text, the newline that ends a sum and the ";" that ends a lookup)."""
    return tuple(i for i in map(tokenizer.token_to_id, STOP_STRINGS) if i is not None) + eos_ids(folder)
