import pytest

from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_tokenizer
from worker.engine.detokenizer import Detokenizer

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


# DecodeStream (the tokenizers library's incremental decoder) against a full decode, and against
# the window algorithm on `decode` that it replaced: same text, same deltas at the same tokens.

def _deltas(tokenizer, ids, stream: bool, stop=(), resumed=(), released=0):
    """Deltas as Sequence.accept asks for them: one per token until a stop string, then flush."""
    detok = Detokenizer(tokenizer.decode, stop, tokenizer.decode_stream if stream else None)
    detok.resume(list(resumed), released)
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.stopped:
            return deltas, detok
    return deltas + [detok.flush()], detok


@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_deltas_are_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, detok = _deltas(tokenizer, ids, stream=True)
    assert "".join(streamed) == tokenizer.decode(ids) == text == detok.text
    assert all("\ufffd" not in d for d in streamed)
    assert streamed == _deltas(tokenizer, ids, stream=False)[0]


def test_decode_stream_holds_a_split_character_and_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("한😀", add_special_tokens=False)
    eos = tokenizer.encode("</s>", add_special_tokens=False)
    assert len(ids) > 2 and len(eos) == 1
    ids = ids[:-1] + eos + ids[-1:]  # an end-of-sequence token inside the emoji's bytes
    streamed, _ = _deltas(tokenizer, ids, stream=True)
    assert "".join(streamed) == "한😀" == tokenizer.decode(ids)
    assert streamed[-2:] == ["😀", ""]


def test_an_incomplete_character_at_the_end_comes_out_of_flush(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)[:-1]
    for stream in (True, False):
        streamed, _ = _deltas(tokenizer, ids, stream)
        assert "".join(streamed) == tokenizer.decode(ids) and streamed[-1].endswith("\ufffd")


@pytest.mark.parametrize("stream", [True, False], ids=["decode_stream", "decode"])
@pytest.mark.parametrize("stop", [(), ("국🚀",)])
def test_a_resumed_stream_continues_exactly_where_the_first_worker_stopped(tokenizer, stream, stop):
    text = "한😀국🚀어 café 🧪"
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole, first = _deltas(tokenizer, ids, stream, stop)
    assert first.stopped == bool(stop)
    consumed = len(whole) - (not first.stopped)  # the last delta is flush()'s unless it stopped
    for k in range(1, consumed):
        sent = "".join(whole[:k])  # what the first worker had published after k tokens
        rest, second = _deltas(tokenizer, ids[k:], stream, stop, resumed=ids[:k], released=len(sent))
        assert rest == whole[k:], f"resumed after {k} tokens"
        assert sent + "".join(rest) == first.text == second.text


def test_a_decode_stream_that_refuses_hands_over_to_the_window_decode(tokenizer):
    ids = tokenizer.encode("안녕하세요, 😀 🚀 café", add_special_tokens=False)

    def refusing_stream():  # as DecodeStream raises when a decoder rewrites earlier text
        step = tokenizer.decode_stream()
        calls = iter(range(len(ids)))
        return lambda token_id: step(token_id) if next(calls) < 5 else _raise()

    def _raise():
        raise Exception("Invalid prefix encountered")

    detok = Detokenizer(tokenizer.decode, (), refusing_stream)
    streamed = [detok.push(t) for t in ids] + [detok.flush()]
    assert streamed == _deltas(tokenizer, ids, stream=False)[0]
    assert "".join(streamed) == tokenizer.decode(ids)
