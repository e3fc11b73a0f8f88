"""Tokenizers: the protocol every loader's tokenizer meets, and the byte-level one of `tiny`."""

from __future__ import annotations

from typing import Protocol, Sequence

from hicache.model.chat import ChatTemplate


class Tokenizer(Protocol):
    """Text <-> token ids. `encode` adds no special tokens: chat templates carry their own."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte, plus BOS/EOS: lengths in tokens are lengths in bytes, which keeps the
    tests' arithmetic obvious. Ids 0..255 are bytes, 256 is BOS, 257 is EOS."""

    BOS = 256
    EOS = 257

    def __init__(self) -> None:
        self.vocab_size = 258
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)
        self.chat_template = ChatTemplate.plain()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
