"""Incremental detokenization with stop strings: the text a request has produced so far, and how much of it
can be sent while more tokens may still come."""

from __future__ import annotations

from typing import Sequence

#: What a decode of an incomplete UTF-8 sequence ends with (byte-level tokens split characters).
REPLACEMENT = "\ufffd"


class TextStream:
    """The decoded text of a growing list of token ids, cut at the first stop string.

    `add` decodes the ids so far (special tokens skipped, as `tokenizer.decode` does by default) and
    reports whether a stop string appeared; `pending` hands out the text not sent yet, holding back
    what could still change: an incomplete character at the end, and the last len(longest stop) − 1
    characters, which a later token could complete into a stop string. Streamed pieces concatenate
    to the final text.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def add(self, token: int) -> bool:
        """Append a token; True when the text now contains a stop string (the text is cut before it)."""
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def pending(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when `final`)."""
        end = len(self.text)
        if not final:
            end = max(self.sent, len(self.text.rstrip(REPLACEMENT)) - self.hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
