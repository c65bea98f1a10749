"""/tokenize and /detokenize in vLLM's shapes, against transformers' tokenizer of the same folder:
a prompt with and without special tokens, a chat through the template with and without the
generation prompt, the tokens' vocabulary pieces, and text back from ids; bad bodies are 400s in
OpenAI's error body, an unknown model 404. Real Redis, the real app (no worker: nothing is queued)."""
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api.app import create_app
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]


@pytest.fixture(scope="module")
def theirs(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
def client(redis_url, prefix, tiny_llama):
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(tiny_llama),
                           served_model_name="m")
    with TestClient(create_app(settings, Tokenizer(tiny_llama)), base_url="http://127.0.0.1") as running:
        yield running


def test_a_prompt_is_tokenized_as_transformers_does(client, theirs):
    text = "The capital of France is Paris, é 東京"
    answer = client.post("/tokenize", json={"model": "m", "prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == theirs(text).input_ids and answer["count"] == len(answer["tokens"])
    assert answer["tokens"][0] == theirs.bos_token_id and answer["max_model_len"] > 0
    assert answer["token_strs"] == theirs.convert_ids_to_tokens(answer["tokens"])
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == theirs(text, add_special_tokens=False).input_ids and bare["token_strs"] is None
    assert bare["count"] == answer["count"] - 1


def test_chat_messages_go_through_the_template(client, theirs):
    answer = client.post("/tokenize", json={"messages": CHAT}).json()
    assert answer["tokens"] == theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    closed = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["tokens"] == theirs.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert closed["count"] < answer["count"]
    doubled = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert doubled["tokens"] == [theirs.bos_token_id, *answer["tokens"]]


def test_chat_template_kwargs_reach_the_template(redis_url, prefix, tmp_path):
    from streamq.testing.tiny_models import build_model
    from tests.unit.test_reasoning import THINKING_TEMPLATE
    folder = build_model(tmp_path, "llama", chat_template=THINKING_TEMPLATE.replace("{{ opening }}", "<think>\n"))
    theirs = AutoTokenizer.from_pretrained(folder)
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(folder), served_model_name="m")
    with TestClient(create_app(settings, Tokenizer(folder)), base_url="http://127.0.0.1") as client:
        closed = client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert closed.json()["tokens"] == theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                                     return_dict=False, enable_thinking=False)
        opened = client.post("/tokenize", json={"messages": CHAT}).json()
        assert opened["count"] < closed.json()["count"]
        taken = client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"bos_token": "x"}})
        assert taken.status_code == 400 and "may not set ['bos_token']" in taken.json()["error"]["message"]


def test_tokens_come_back_as_text(client, theirs):
    text = "Hello there, é 東京"
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    back = client.post("/detokenize", json={"model": "m", "tokens": ids}).json()
    assert back == {"prompt": theirs.decode(ids)} and back["prompt"].endswith(text)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, None),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"enable_thinking": False}}, None),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, None),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_a_bad_body_is_a_400_in_openais_shape(client, path, body, param):
    reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_an_unknown_model_is_404(client):
    reply = client.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
