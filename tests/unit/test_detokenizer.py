import pytest

from shared.tokenizer import Tokenizer
from tests.tiny_models import build_tokenizer
from worker.detokenizer import Detokenizer

TEXTS = ["안녕하세요, 반갑습니다. 😀 🚀", "café naïve 🧪 emoji", "plain ascii words only", "한😀국🚀어"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return Tokenizer(folder)


def _run(tokenizer, ids, stop=()):
    detok = Detokenizer(tokenizer.decode, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.stopped:
            break
    if not detok.stopped:
        deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_split_a_character_and_add_up_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "multi-byte characters must span several tokens for this test"
    detok, deltas = _run(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text


def test_a_character_split_over_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = Detokenizer(tokenizer.decode)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "😀"


def test_stop_string_is_cut_and_never_shown_in_part(tokenizer):
    text = "Once upon a time there was a small model"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _run(tokenizer, ids, stop=["there was"])
    assert detok.stopped
    assert "".join(deltas) == "Once upon a time " == detok.text
    assert not any("there" in d for d in deltas)


def test_text_that_only_looks_like_a_stop_string_is_released(tokenizer):
    text = "the capital of France"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _run(tokenizer, ids, stop=["the end", "France!"])
    assert not detok.stopped
    assert "".join(deltas) == text
    # While "France" could still become "France!", it is held back, then released by flush().
    assert deltas[-1].endswith("France")


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("a b c d e", add_special_tokens=False)
    detok, deltas = _run(tokenizer, ids, stop=["d", "b c"])
    assert "".join(deltas) == "a " and detok.text == "a "
