"""A model that thinks aloud, through the whole stack with the openai and anthropic clients: on a
tiny llama whose chat template opens a thought (its generation prompt ends with <think>, so the
api reads its replies with the think parser), a reply written as a thought, </think>, then the
answer (a regex constraint writes it: a tiny model does not close a thought by itself) comes
back with the thought in reasoning_content and never in content, whole and streamed; on
Messages, a reply that never leaves its thought is one thinking block."""
from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from api.anthropic.answers import MessageAnswer
from api.openai.answers import ChatCompletion
from api.openai.responses.answers import ResponseObject
from tests.stack import Stack
from tests.unit.test_reasoning import THINKING_TEMPLATE
from streamq.testing.tiny_models import build_model

# A tiny model never closes its thought: a budget of 6 closes it (the sampler writes </think>), and
# the constraint applies to the answer after it, the thought staying free.
WRITTEN = {"thinking_token_budget": 6, "structured_outputs": {"regex": r"[a-z]{3,8}"}, "temperature": 0}
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    model = build_model(tmp_path_factory.mktemp("tiny-llama-thinking"), "llama", context=1024,
                        chat_template=THINKING_TEMPLATE.replace("{{ opening }}", "<think>\n"))
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
    # The answer under the regex, the thought free of it (the model's own characters)
    assert thought and not re.fullmatch(r"[a-z]*", thought) and re.fullmatch(r"[a-z]{3,8}", answer)
    assert message["reasoning"] == thought and whole.choices[0].finish_reason == "stop"

    reasoning_tokens = whole.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=64,
                                                 extra_body=WRITTEN, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    deltas = [c.choices[0].delta.to_dict() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert not any("<" in (d.get("content") or "") for d in deltas)


def test_a_thought_cut_by_max_tokens_is_all_reasoning(stack, client):
    cut = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=4, extra_body=WRITTEN)
    message = cut.choices[0].message.to_dict()
    assert cut.choices[0].finish_reason == "length" and message["content"] is None
    assert cut.usage.completion_tokens_details.reasoning_tokens == cut.usage.completion_tokens == 4
    assert message["reasoning_content"] and "<" not in message["reasoning_content"]


def test_messages_give_the_thought_as_a_thinking_block(stack, client):
    chat = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=8, temperature=0)
    thought = chat.choices[0].message.to_dict()["reasoning_content"]
    assert thought and chat.choices[0].message.content is None  # never left its thought
    claude = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0)
    message = claude.messages.create(model=stack.model_name, max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    MessageAnswer.model_validate(message.to_dict())
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", thought)]
    with claude.messages.stream(model=stack.model_name, max_tokens=8, messages=ASK,
                                extra_body={"temperature": 0}) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        streamed = stream.get_final_message()
    assert [(b.type, b.thinking) for b in streamed.content] == [("thinking", thought)]
    assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "signature_delta") in kinds
    # An assistant's earlier thinking block is taken back, and left out of the prompt.
    again = [*ASK, {"role": "assistant", "content": [b.to_dict() for b in message.content] + [
        {"type": "text", "text": "Hello."}]}, {"role": "user", "content": "Again."}]
    assert claude.messages.count_tokens(model=stack.model_name, messages=again).input_tokens == \
        claude.messages.count_tokens(model=stack.model_name, messages=[
            *ASK, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again."}]).input_tokens


def test_responses_give_the_thought_as_a_reasoning_item(stack, client):
    chat = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=8, temperature=0)
    thought = chat.choices[0].message.to_dict()["reasoning_content"]
    first = client.responses.create(model=stack.model_name, input="Say hello.", max_output_tokens=8, temperature=0)
    ResponseObject.model_validate(first.to_dict())
    assert [(i.type, i.content[0].text) for i in first.output] == [("reasoning", thought)]
    assert first.status == "incomplete" and first.output_text == ""
    assert first.usage.output_tokens_details.reasoning_tokens == first.usage.output_tokens == 8  # all thought
    events = list(client.responses.create(model=stack.model_name, input="Say hello.", max_output_tokens=8,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert not [e for e in events if e.type == "response.output_text.delta"]
    assert events[-1].response.output[0].content[0].text == thought
    # The next turn takes the reasoning item back, by previous_response_id or in the input.
    again = client.responses.create(model=stack.model_name, previous_response_id=first.id, input="Again.",
                                    max_output_tokens=2, temperature=0)
    sent = client.responses.create(model=stack.model_name, max_output_tokens=2, temperature=0,
                                   input=[{"role": "user", "content": "Say hello."},
                                          *[i.to_dict() for i in first.output], {"role": "user", "content": "Again."}])
    assert again.usage.input_tokens == sent.usage.input_tokens


def test_a_chat_whose_template_kwargs_close_the_thought_is_all_answer(stack, client):
    thinking = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=8, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = plain.choices[0].message.to_dict()
    assert message["content"] and message.get("reasoning_content") is None
    # The template closed an empty thought in the prompt: more prompt tokens than the thinking chat's.
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set"):
        client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


def test_a_thinking_budget_closes_the_thought_and_the_answer_follows(stack, client):
    """Messages' thinking.budget_tokens: the tiny model never closes its thought itself; with a budget
    of 5 the sampler writes </think> after 5 thought tokens, and the reply goes on as the answer."""
    five = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=5, temperature=0)
    first_five = five.choices[0].message.to_dict()["reasoning_content"]  # the greedy thought's first 5 tokens
    claude = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0)
    budget = {"type": "enabled", "budget_tokens": 5}
    message = claude.messages.create(model=stack.model_name, max_tokens=24, messages=ASK, thinking=budget,
                                     extra_body={"temperature": 0})
    MessageAnswer.model_validate(message.to_dict())
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "text"], kinds
    assert message.content[0].thinking == first_five
    assert message.content[1].text and "</think>" not in message.content[1].text
    assert message.usage.output_tokens == 24 and message.stop_reason == "max_tokens"
    with claude.messages.stream(model=stack.model_name, max_tokens=24, messages=ASK, thinking=budget,
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content]
    unbounded = claude.messages.create(model=stack.model_name, max_tokens=24, messages=ASK,
                                       extra_body={"temperature": 0})
    assert [b.type for b in unbounded.content] == ["thinking"]  # without the budget: all thought


def test_thinking_disabled_is_the_templates_enable_thinking_off(stack):
    claude = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0)
    message = claude.messages.create(model=stack.model_name, max_tokens=8, messages=ASK,
                                     thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["text"]


@pytest.mark.parametrize("thinking, extra", [
    ({"type": "enabled", "budget_tokens": 16}, {}),  # not below max_tokens
    ({"type": "enabled"}, {}),
    ({"type": "disabled", "budget_tokens": 4}, {}),
])
def test_a_thinking_setting_that_cannot_run_is_a_400(stack, thinking, extra):
    import httpx

    reply = httpx.post(f"{stack.urls[0]}/v1/messages", json={"model": stack.model_name, "max_tokens": 16,
                                                             "messages": ASK, "thinking": thinking, **extra},
                       timeout=60)
    assert reply.status_code == 400, reply.text
    assert "thinking" in reply.text


def test_a_tool_call_after_a_free_thought(stack, client):
    """A tool constraint applies after the thought (free, closed here by the budget), not from the
    reply's first token: the thought is the model's own, the call validates."""
    tools = [{"type": "function", "function": {"name": "greet", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}]
    reply = client.chat.completions.create(model=stack.model_name, messages=ASK, max_tokens=200, temperature=0,
                                           tools=tools, tool_choice="required",
                                           extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    thought = message.to_dict()["reasoning_content"]
    assert thought and not thought.startswith('{"tool_calls"')  # the thought is not the constraint's
    if reply.choices[0].finish_reason == "tool_calls":  # else cut by max_tokens, which says so
        call = message.tool_calls[0]
        assert call.function.name == "greet" and len(json.loads(call.function.arguments)["name"]) <= 8
    else:
        assert reply.choices[0].finish_reason == "length" and not message.tool_calls


def test_a_budget_on_a_model_that_does_not_think_is_a_400(redis_url, tmp_path_factory):
    """thinking_token_budget needs a reasoning parser: on a model without one, a 400 naming it."""
    import httpx

    model = build_model(tmp_path_factory.mktemp("tiny-llama-plain"), "llama")
    with Stack(redis_url, model, tmp_path_factory.mktemp("plain")) as plain:
        reply = httpx.post(f"{plain.urls[0]}/v1/chat/completions", json={
            "model": plain.model_name, "messages": ASK, "max_tokens": 8, "thinking_token_budget": 4}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "thinking_token_budget", reply.text
