"""A model that thinks aloud, through the whole stack and the openai client: on a tiny llama whose
chat template knows </think> (so the api reads its replies with the think parser), a reply
written as <think>…</think> then the answer (a regex constraint writes it: a tiny model does not
think by itself) comes back with the thought in reasoning_content and never in content, whole
and streamed."""
from __future__ import annotations

import re

import openai
import pytest

from api.openai.answers import ChatCompletion
from tests.stack import Stack
from tests.unit.test_reasoning import THINKING_TEMPLATE
from streamq.testing.tiny_models import build_model

WRITTEN = {"structured_outputs": {"regex": r"<think>[a-z]{3,8} [a-z]{3,8}</think>[a-z]{3,8}"}, "temperature": 0}
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    model = build_model(tmp_path_factory.mktemp("tiny-llama-thinking"), "llama", context=1024,
                        chat_template=THINKING_TEMPLATE.replace("{{ opening }}", ""))
    with Stack(redis_url, model, tmp_path_factory.mktemp("reasoning")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0)


def test_the_thought_comes_apart_from_the_answer_whole_and_streamed(stack, client):
    whole = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=64, extra_body=WRITTEN)
    ChatCompletion.model_validate(whole.to_dict())
    message = whole.choices[0].message.to_dict()
    thought, answer = message["reasoning_content"], message["content"]
    assert re.fullmatch(r"[a-z]{3,8} [a-z]{3,8}", thought) and re.fullmatch(r"[a-z]{3,8}", answer)
    assert message["reasoning"] == thought and whole.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=64,
                                                 extra_body=WRITTEN, stream=True))
    deltas = [c.choices[0].delta.to_dict() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert not any("<" in (d.get("content") or "") for d in deltas)


def test_a_thought_cut_by_max_tokens_is_all_reasoning(stack, client):
    cut = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=10, extra_body=WRITTEN)  # "<think>" is 7 tokens here
    message = cut.choices[0].message.to_dict()
    assert cut.choices[0].finish_reason == "length" and message["content"] is None
    assert message["reasoning_content"] and "<" not in message["reasoning_content"]
