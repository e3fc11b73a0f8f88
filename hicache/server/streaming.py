"""Serving: incremental detokenization of one streamed choice.

A stream must never show text it would later have to take back. Two things make the tail of a decoded
output unstable: a multi-byte UTF-8 character split over tokens (it decodes as U+FFFD until its last
byte arrives) and a stop string that may be forming (it must never be shown). So trailing U+FFFD is
held until it resolves, and the last len(longest stop) - 1 characters are held until they are clear.

Decoding all output tokens at every step would cost O(n) per token, O(n²) per stream. Instead only a
window is decoded: the tokens not yet turned into text plus the chunk before them, whose text is
subtracted (the context keeps decoders that treat a sequence's first token specially, such as
SentencePiece's leading space, consistent). The window slides forward whenever it ends on a whole
character. The final piece comes from `Engine.detokenize` over all tokens, exactly as a non-streamed
response computes its text, so the concatenated stream always equals the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
Detokenize = Callable[[Sequence[int], str | int | None], str]

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, detokenize: Detokenize, stop: Sequence[str] = ()) -> None:
        """`decode`: the tokenizer's; `detokenize`: the engine's final-text rule (stop token and stop
        string removed)."""
        self._decode = decode
        self._detokenize = detokenize
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # first token of the decode window (context)
        self._read = 0  # first token of the window not yet turned into text
        self._prefix_chars = 0  # len(decode(ids[prefix:read]))
        self._taken = 0  # characters of the window past the context already turned into text
        self._held = ""  # stable text not emitted yet: a stop string may be forming in it
        self._emitted = 0  # characters emitted in total

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens of an unfinished request; return the text that became safe to show."""
        held = self._held + self._stable_text(token_ids)
        cut = max(len(held) - self._holdback, 0)
        out, self._held = held[:cut], held[cut:]
        self._emitted += len(out)
        return out

    def finish(self, token_ids: Sequence[int], matched_stop: str | int | None) -> str:
        """Add the last tokens; return everything not yet emitted, cut at the stop string or stop token."""
        self._ids.extend(token_ids)
        return self._detokenize(self._ids, matched_stop)[self._emitted :]

    def _stable_text(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix :])
        start = self._prefix_chars + self._taken
        end = len(text)
        while end > start and text[end - 1] == REPLACEMENT:
            end -= 1
        piece = text[start:end]
        if end == len(text):
            # The window ends on a whole character: what follows decodes independently of it.
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_chars = len(self._decode(self._ids[self._prefix : self._read]))
            self._taken = 0
        else:
            self._taken += len(piece)
        return piece
