"""Incremental detokenization with stop strings: the text a request has produced so far, and how much of it
can be sent while more tokens may still come."""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream


class TextStream:
    """The decoded text of a growing list of token ids, cut at the first stop string.

    `add` decodes each token as it comes (`tokenizers.decoders.DecodeStream`, special tokens skipped as
    `tokenizer.decode` does by default: constant work a token, where decoding all ids again would be
    quadratic in the output's length) and reports whether a stop string appeared; a token that leaves a
    character incomplete adds no text until one completes it. `pending` hands out the text not sent yet,
    holding back the last len(longest stop) − 1 characters, which a later token could complete into a
    stop string. Streamed pieces concatenate to `tokenizer.decode(ids)` cut at the stop.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._decoded = 0  # ids whose text is in `text`

    def add(self, token: int) -> bool:
        """Append a token; True when the text now contains a stop string (the text is cut before it)."""
        self.ids.append(int(token))
        piece = self._decoder.step(self.tokenizer, int(token))
        return piece is not None and self._extend(piece)

    def _extend(self, piece: str) -> bool:
        """Append decoded text and look for a stop string where it could newly begin."""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        self._decoded = len(self.ids)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def pending(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when `final`, including the
        replacement character of a sequence the ids left incomplete)."""
        if final and not self.stopped and self._decoded < len(self.ids):
            self._extend(self.tokenizer.decode(self.ids)[len(self.text):])
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
