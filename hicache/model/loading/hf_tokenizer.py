"""The `Tokenizer` protocol over a Hugging Face `tokenizers.Tokenizer`, used by both checkpoint loaders:
the GGUF loader builds the `tokenizers` object from the file's vocabulary and merges, the Hugging Face
directory loader reads it from tokenizer.json."""

from __future__ import annotations

from typing import Sequence

import tokenizers

from hicache.model.chat import ChatTemplate


class HFTokenizer:
    """Encodes without adding BOS/EOS (chat templates carry their own), but special tokens written in the
    text, such as `<|im_start|>`, still become their single ids: templates are rendered to text first.
    Decoding keeps special tokens, so what the model emitted is what the caller sees."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: ChatTemplate,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)
