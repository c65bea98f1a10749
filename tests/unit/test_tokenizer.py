"""The api's tokenizer (no transformers) must agree with transformers' own."""
import pytest

from shared.tokenizer import ChatTemplateError, Tokenizer
from streamq.testing.tiny_models import CONTEXT, build_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "안녕? What is 2+2?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return folder


def test_encode_and_chat_template_match_transformers(folder):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.encode("Hello there 😀") == theirs("Hello there 😀")["input_ids"]
    assert ours.render_chat(MESSAGES) == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours.encode_chat(MESSAGES) == list(expected)


def test_limits_and_special_tokens_come_from_the_folder(folder):
    tok = Tokenizer(folder)
    assert tok.eos_token == "</s>" and 2 in tok.eos_token_ids
    assert tok.encode("hi")[0] == 1  # the post-processor adds <s>
    assert tok.context_length == 2048  # no config.json here: the documented fallback
    assert CONTEXT < tok.context_length


def test_a_model_without_template_refuses_chat(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError):
        Tokenizer(tmp_path).render_chat(MESSAGES)


def test_missing_tokenizer_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare-model"):
        Tokenizer(tmp_path)
