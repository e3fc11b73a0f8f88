"""The incremental detokenizer: multi-byte UTF-8 split over tokens, stop strings held back until clear,
the stop token left out, and the stream always adding up to the non-streamed text."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.engine.engine import Engine
from hicache.model.tokenizer import ByteTokenizer
from hicache.server.streaming import IncrementalDetokenizer

# Engine.detokenize only needs the tokenizer: test the engine's own final-text rule, not a copy of it.
_engine = SimpleNamespace(tokenizer=ByteTokenizer())


def detokenize(ids, matched_stop=None) -> str:
    return Engine.detokenize(_engine, ids, matched_stop)  # type: ignore[arg-type]


class LeadingSpaceTokenizer(ByteTokenizer):
    """Drops one leading space of what it decodes, as SentencePiece decoders do: a decoder for which
    decoding a window is not the same as slicing the whole decoded text."""

    def decode(self, ids) -> str:
        text = super().decode(ids)
        return text[1:] if text.startswith(" ") else text


def stream(ids: list[int], stop: tuple[str, ...] = (), matched_stop=None, step: int = 1, engine=_engine) -> list[str]:
    """Pushes all but the last token `step` at a time; the last one comes with the finish, as the
    engine's final event carries the token that ended the request."""

    def final(ids, matched_stop):
        return Engine.detokenize(engine, ids, matched_stop)  # type: ignore[arg-type]

    detok = IncrementalDetokenizer(engine.tokenizer.decode, final, stop)
    body = ids[:-1]
    pieces = [detok.push(body[i : i + step]) for i in range(0, len(body), step)]
    pieces.append(detok.finish(ids[-1:], matched_stop))
    return pieces


def test_multibyte_characters_are_emitted_whole() -> None:
    text = "héllo 中文 😀!"
    pieces = stream(list(text.encode()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces  # emitted once its fourth byte arrived, not before


def test_stop_string_is_never_emitted() -> None:
    ids = list(b"abc STOP def")
    pieces = stream(ids[: ids.index(ord("P")) + 1], stop=("STOP",), matched_stop="STOP")
    assert "".join(pieces) == "abc "
    assert all("S" not in p for p in pieces)


def test_partial_stop_match_is_released_when_it_diverges() -> None:
    detok = IncrementalDetokenizer(_engine.tokenizer.decode, detokenize, ("STOP",))
    assert detok.push(list(b"xSTO")) == "x"  # "STO" could still become "STOP"
    assert detok.push(list(b"X")) == "S"  # the last len("STOP") - 1 characters are always held
    assert detok.finish([], None) == "TOX"


def test_stop_token_is_left_out() -> None:
    ids = list(b"done") + [ByteTokenizer.EOS]
    assert "".join(stream(ids, matched_stop=ByteTokenizer.EOS)) == "done"


# Bytes that spell the stop strings' characters often, plus any byte at all (invalid UTF-8 included).
_bytes = st.lists(st.sampled_from(list(b"ab  ") + list("é中".encode())) | st.integers(0, 255), min_size=1, max_size=40)


def test_decoding_cost_is_linear() -> None:
    decoded = []

    class CountingTokenizer(ByteTokenizer):
        def decode(self, ids) -> str:
            decoded.append(len(ids))
            return super().decode(ids)

    ids = list(("héllo wörld, 中文 " * 200).encode())
    pieces = stream(ids, engine=SimpleNamespace(tokenizer=CountingTokenizer()))
    assert "".join(pieces) == detokenize(ids)
    assert sum(decoded[:-1]) < 10 * len(ids)  # all but the final, whole decode


@settings(max_examples=200, deadline=None)
@given(
    ids=_bytes,
    stop=st.lists(st.text(alphabet="abé中", min_size=1, max_size=3), max_size=2),
    step=st.integers(1, 3),
    leading_space=st.booleans(),
)
def test_stream_adds_up_to_the_final_text(ids: list[int], stop: list[str], step: int, leading_space: bool) -> None:
    engine = SimpleNamespace(tokenizer=LeadingSpaceTokenizer() if leading_space else ByteTokenizer())

    def final(ids, matched_stop=None):
        return Engine.detokenize(engine, ids, matched_stop)  # type: ignore[arg-type]

    # Generation ends at the first token after which a stop string is in the text, as the engine ends it.
    matched = None
    for end in range(1, len(ids) + 1):
        matched = next((s for s in stop if s in final(ids[:end])), None)
        if matched is not None:
            ids = ids[:end]
            break
    pieces = stream(ids, tuple(stop), matched, step, engine)
    final_text = final(ids, matched)
    assert "".join(pieces) == final_text
    emitted = ""
    for piece in pieces[:-1]:
        emitted += piece
        assert final_text.startswith(emitted)
        assert not any(s in emitted for s in stop)
