"""Streamed text: pieces concatenate to the full text; stop strings and partial characters are held back."""

from __future__ import annotations

import pytest

from deployments.text_stream import TextStream, truncate_at_stop


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from deployments.app_config import ModelSource

    src = ModelSource.model_validate({"tiny": {"arch": "deepseek_v32"},
                                      "cache_dir": str(tmp_path_factory.mktemp("tok"))})
    return AutoTokenizer.from_pretrained(src.checkpoint_dir(make=True))


def ids_of(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer maps bytes to ids 0-255


def stream(tok, ids, stop=(), step=1):
    ts = TextStream(tok, stop)
    pieces = [ts.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(ts.finish())
    return pieces, ts


def test_truncate_at_stop():
    assert truncate_at_stop("abcdef", ("de", "b")) == ("a", True)
    assert truncate_at_stop("abc", ("x",)) == ("abc", False)
    assert truncate_at_stop("abc", ()) == ("abc", False)


def test_pieces_join_to_the_text_and_multibyte_characters_wait(tok):
    text = "naïve → 稀疏注意力 ok"
    pieces, ts = stream(tok, ids_of(text))
    assert "".join(pieces) == text == ts.text
    assert all("\ufffd" not in p for p in pieces)  # a character is sent only once all its bytes are in


def test_special_tokens_are_not_text(tok):
    pieces, _ = stream(tok, ids_of("hi") + [tok.eos_token_id])
    assert "".join(pieces) == "hi"


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_is_cut_and_its_prefix_held_back(tok, step):
    text = "one two. three"
    pieces, ts = stream(tok, ids_of(text), stop=("o. t", "zz"), step=step)
    assert "".join(pieces) == "one tw" == ts.text and ts.stopped
    # "one tw" then "o" could start "o. t": nothing past "one tw" is ever sent early.
    sent = ""
    for p in pieces:
        sent += p
        assert "one tw".startswith(sent)


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(tok):
    pieces, ts = stream(tok, ids_of("ab. c"), stop=("b!",))
    assert "".join(pieces) == "ab. c" and not ts.stopped
    assert pieces[1] == "" and pieces[2] == "b."  # "b" waited for the next character
