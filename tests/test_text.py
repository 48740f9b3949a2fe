"""Incremental detokenization and stop strings, with the real Qwen2.5 tokenizer."""

import pytest
from tokenizers import Tokenizer

from specd.model.fetch import resolve_tokenizer
from specd.orchestrator.text import OutputText

SAMPLES = ["héllo wörld, 日本語のテキスト 🚀🎉 end", "def f(x):\n    return x  # ∑ → ∞", "  leading spaces\tand tabs"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(f"{resolve_tokenizer('draft')}/tokenizer.json")


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_text_equals_whole_decode_whatever_the_chunking(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    output = OutputText(tokenizer)
    pieces = [output.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [output.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)  # no half characters ever printed


def test_a_stream_ending_inside_a_character_prints_it_whatever_the_chunking(tokenizer):
    """The last tokens end in half a character: held back while streaming, printed (as decode prints
    them) at the end, so every grouping of the tokens into steps gives the same text."""
    ids = tokenizer.encode("ok 日本語", add_special_tokens=False).ids
    lead_byte = tokenizer.token_to_id("ð")  # byte 0xF0 (byte-level BPE's alphabet): a 4-byte character begins
    cut = ids + [lead_byte]
    expected = tokenizer.decode(cut)
    assert expected.endswith("\ufffd")
    for chunk in (1, 2, 3, len(cut)):
        output = OutputText(tokenizer)
        pieces = [output.add(cut[i : i + chunk]) for i in range(0, len(cut), chunk)]
        assert "\ufffd" not in "".join(pieces)  # never while streaming
        assert "".join(pieces) + output.finish() == expected, chunk


def test_stop_string_cuts_the_output_even_across_chunks(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta", add_special_tokens=False).ids
    output = OutputText(tokenizer, stop=["STOP"])
    printed = "".join(output.add([token]) for token in ids) + output.finish()
    assert printed == "alpha beta "
    assert output.stopped


def test_text_that_could_start_a_stop_string_is_held_back_then_released(tokenizer):
    output = OutputText(tokenizer, stop=["\n\n\n"])
    first = output.add(tokenizer.encode("x = 1\n", add_special_tokens=False).ids)
    assert first == "x = 1"  # the newline might begin the stop string
    rest = output.add(tokenizer.encode("y", add_special_tokens=False).ids) + output.finish()
    assert first + rest == "x = 1\ny" and not output.stopped
