"""TextStream: incremental detokenization against decoding all ids at once, stop strings held back."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rq_jax.serve.text import TextStream
from rq_jax.tokenizer import SPECIAL_TOKENS, byte_level_tokenizer


def _bpe() -> Tokenizer:
    """A byte-level BPE with merges, trained on text with multi-byte characters (so tokens split them)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["naïve café — 12 + 30 = 42 ✓ 数字 and émigré ünïcödé 🙂"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _stream(tokenizer, ids, stop, rng):
    """Feed ids until a stop, taking `pending` at random moments; the pieces and the stream."""
    stream, pieces = TextStream(tokenizer, stop), []
    for token in ids:
        if stream.add(token):
            break
        if rng.random() < 0.5:
            pieces.append(stream.pending())
    pieces.append(stream.pending(final=True))
    return pieces, stream


def test_text_stream_holds_back_possible_stop_strings():
    tok = byte_level_tokenizer()
    stream = TextStream(tok, stop=("END",))
    pieces = []
    for token in tok.encode("abcEN").ids:
        assert not stream.add(token)
        pieces.append(stream.pending())
    assert "".join(pieces) == "abc"  # "EN" might start "END"
    assert stream.add(tok.encode("D").ids[0]) and stream.pending(final=True) == "" and stream.text == "abc"


@pytest.mark.parametrize("make", [byte_level_tokenizer, _bpe])
def test_text_stream_pieces_are_the_whole_decode_cut_at_the_stop(make):
    """Random ids (split characters, special tokens, bytes no character completes) and stop strings: the
    streamed pieces concatenate to decoding every id at once, cut before the first stop."""
    tok, rng = make(), random.Random(0)
    text = "naïve café — 12 + 30 = 42 ✓ 数字 🙂 END<|im_end|>"
    for trial in range(300):
        if trial % 2:
            ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        else:
            ids = tok.encode(text[rng.randrange(len(text)):]).ids
        stop = rng.choice([(), ("END",), ("é", "✓ 数"), ("<|im_end|>",)])
        pieces, stream = _stream(tok, ids, stop, rng)
        whole = tok.decode(stream.ids)
        cut = min([i for i in (whole.find(s) for s in stop) if i >= 0], default=len(whole))
        assert "".join(pieces) == whole[:cut], (ids, stop)
        assert stream.stopped == (cut < len(whole))
