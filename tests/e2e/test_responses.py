"""OpenAI's Responses API through the whole stack (two api replicas, one worker, the tiny llama),
with the official openai client: every call it has, the events and their sequence numbers, a
stream resumed on the other replica, conversations, tools, parse, cancel, delete, and the errors."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.openai.answers import OpenAIError
from api.openai.responses.answers import InputItemList, ResponseObject
from shared import redis_keys
from tests.e2e.helpers import held_mid_response
from tests.stack import Stack, parse_sse
from streamq.testing.tiny_models import build_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """Two api replicas and a worker on a tiny llama of 2,048 positions (a tool's description in
    the prompt outgrows 256)."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", context=2048)
    with Stack(redis_url, model, tmp_path_factory.mktemp("responses"), replicas=2) as running:
        yield running


@pytest.fixture(scope="module")
def other(stack):
    """The client on the second replica."""
    return openai.OpenAI(base_url=f"{stack.urls[1]}/v1", api_key="unused", max_retries=0)


def _text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "message" for part in item.content)


def _chat_text(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_a_response_is_the_chat_reply_to_the_same_conversation(client, model):
    response = client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                       temperature=0, max_output_tokens=12)
    text, reason = _chat_text(client, model, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello there"}], 12)
    assert response.id.startswith("resp_") and response.object == "response"
    assert _text(response) == text
    assert response.status == ("incomplete" if reason == "length" else "completed")
    if reason == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.output_tokens == 12 or reason == "stop"
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    ResponseObject.model_validate(response.to_dict())
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()


def test_stream_events_are_numbered_and_add_up_to_the_response(client, model):
    events = list(client.responses.create(model=model, input="Count", temperature=0, max_output_tokens=10,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == _text(final) == events[-4].text
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_background_stream_resumes_on_the_other_replica_after_any_event(client, other, model):
    created = client.responses.create(model=model, input="Tell me a story", temperature=0, max_output_tokens=16,
                                      background=True)
    assert created.status == "queued" and created.background
    # At once, before the events after 3 may exist: they come as they are made.
    early = list(other.responses.retrieve(created.id, stream=True, starting_after=3))
    whole = list(client.responses.retrieve(created.id, stream=True))
    assert [e.model_dump() for e in early] == [e.model_dump() for e in whole[4:]]
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    for after in (0, 3, len(whole) - 2):
        rest = list(other.responses.retrieve(created.id, stream=True, starting_after=after))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in whole[after + 1:]]
    assert other.responses.retrieve(created.id).status in ("completed", "incomplete")


def test_a_dropped_foreground_stream_goes_on_and_resumes(client, other, model):
    """Stored (the default): the client hangs up after the first text, the response runs to its
    end, and the other replica streams exactly the rest."""
    whole = client.responses.create(model=model, input="Tell me a story", temperature=0, max_output_tokens=16)
    stream = client.responses.create(model=model, input="Tell me a story", temperature=0, max_output_tokens=16,
                                     stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()
    rest = list(other.responses.retrieve(seen[0].response.id, stream=True,
                                         starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.status == whole.status


def test_a_dropped_stream_with_store_false_is_cancelled_and_forgotten(stack, client, model):
    stream = client.responses.create(model=model, input="Go on and on", max_output_tokens=200, stream=True,
                                     store=False)
    first = next(iter(stream))
    stack.pause_worker()  # it cannot finish before the hang-up
    redis = stack.redis()
    record = redis_keys.response_record(stack.prefix, "", first.response.id)
    request_id = redis.hget(record, "request_id")
    try:
        stream.close()
    finally:
        stack.resume_worker()
    deadline = time.monotonic() + 60
    while redis.exists(record):  # the replica cancels it, waits for its end, then deletes all
        assert time.monotonic() < deadline, "the response was not forgotten"
        time.sleep(0.05)  # re-read Redis: the replica's clean-up is not ours to order
    assert redis.exists(redis_keys.request_record(stack.prefix, request_id),
                        redis_keys.token_log(stack.prefix, request_id)) == 0


def test_a_conversation_continues_from_the_stored_response(client, other, model):
    first = client.responses.create(model=model, input="My name is Ada.", temperature=0, max_output_tokens=8)
    second = other.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                    temperature=0, max_output_tokens=8)
    text, _ = _chat_text(client, model, [{"role": "user", "content": "My name is Ada."},
                                         {"role": "assistant", "content": _text(first)},
                                         {"role": "user", "content": "What is my name?"}], 8)
    assert _text(second) == text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # its own input only
    assert items.data[0].content[0].text == "What is my name?"


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The forecast",
                "parameters": Weather.model_json_schema(), "strict": True}


def test_a_function_call_round_trip(client, model):
    asked = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=200)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert asked.status == "completed", asked
    assert len(calls) == 1 and calls[0].name == "get_weather"
    Weather.model_validate_json(calls[0].arguments)
    ResponseObject.model_validate(asked.to_dict())  # its function_call item
    answered = client.responses.create(
        model=model, previous_response_id=asked.id, tools=[WEATHER_TOOL], tool_choice="none", temperature=0,
        max_output_tokens=6, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                     "output": "sunny, 21 C"}])
    assert answered.output[0].type == "message" and answered.status in ("completed", "incomplete")
    items = client.responses.input_items.list(answered.id, order="asc")
    assert [i.type for i in items.data] == ["function_call_output"]
    assert items.data[0].call_id == calls[0].call_id
    InputItemList.model_validate(client.responses.input_items.with_raw_response.list(answered.id).http_response.json())


@pytest.mark.parametrize("seed", range(4))
def test_a_call_cut_by_max_output_tokens_is_incomplete_never_text(client, model, seed):
    """At temperature 1 with a tight budget: one whole call, or incomplete with no call and no text."""
    response = client.responses.create(model=model, input=f"Weather {seed}?", tools=[WEATHER_TOOL],
                                       tool_choice="required", temperature=1.0, max_output_tokens=30)
    calls = [item for item in response.output if item.type == "function_call"]
    if response.status == "completed":
        assert len(calls) == 1
        Weather.model_validate_json(calls[0].arguments)
    else:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output == []


def test_parse_gives_the_pydantic_model(client, model):
    parsed = client.responses.parse(model=model, input="Weather?", text_format=Weather, temperature=0,
                                    max_output_tokens=80)
    assert parsed.status == "completed", parsed
    assert isinstance(parsed.output_parsed, Weather)


def test_cancel_stops_a_running_background_response(stack, client, model):
    """The worker is paused at a delta until the cancel is published to it, so the tiny model
    cannot end the response first, however late the cancel comes on a loaded machine."""
    created, stream, _ = held_mid_response(client, stack, "Go on and on", 1500)
    stream.close()
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            with stack.cancel_published():  # the cancel answers once the worker stopped: it waits beside
                pending = pool.submit(http.post, f"{stack.urls[1]}/v1/responses/{created.id}/cancel")
            stack.resume_workers()
            cancelled = pending.result().json()
    finally:
        stack.resume_workers()
    assert cancelled["status"] == "cancelled", cancelled
    ResponseObject.model_validate(cancelled)
    assert 1 <= cancelled["usage"]["output_tokens"] < 1500
    assert client.responses.retrieve(created.id).status == "cancelled"
    finished = client.responses.cancel(created.id)  # a finished one is answered as it is
    assert finished.status == "cancelled"


def test_a_queued_background_response_is_cancelled_at_once(stack, client, model):
    stack.pause_worker()
    try:
        created = client.responses.create(model=model, input="Wait", max_output_tokens=5, background=True)
        cancelled = client.responses.cancel(created.id)
    finally:
        stack.resume_worker()
    assert cancelled.status == "cancelled" and cancelled.output == []


def test_delete_removes_it_everywhere(client, other, model):
    response = client.responses.create(model=model, input="Forget me", max_output_tokens=4)
    assert client.responses.delete(response.id) is None
    for c in (client, other):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.input_items.list(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false_keeps_nothing(client, model):
    response = client.responses.create(model=model, input="Ephemeral", max_output_tokens=4, store=False)
    assert response.status in ("completed", "incomplete") and response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "background": True, "store": False}, None),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "x", "tool_choice": "required"}, None),
])
def test_bad_requests_get_openai_400s(stack, model, body, param):
    reply = httpx.post(f"{stack.urls[0]}/v1/responses", json={"model": model, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    OpenAIError.model_validate(reply.json())
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_unknown_ids_and_bad_resumes(stack, client, model):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    done = client.responses.create(model=model, input="x", max_output_tokens=3)
    events = list(client.responses.retrieve(done.id, stream=True))
    url = f"{stack.urls[0]}/v1/responses/{done.id}"
    for after in (-1, len(events)):
        reply = httpx.get(url, params={"stream": "true", "starting_after": after}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "starting_after", reply.text
    last = httpx.get(url, params={"stream": "true"}, headers={"Last-Event-ID": str(len(events) - 2)}, timeout=30)
    assert [e["data"]["type"] for e in parse_sse(last.text.splitlines())] == [events[-1].type]


@pytest.mark.parametrize("item", [{"type": {}, "call_id": "0", "output": ""}, {"type": ["message"]},
                                  {"role": "user", "content": [{"type": {}, "text": "x"}]}, "text", None])
def test_malformed_input_items_are_400s_never_500s(stack, item):
    """Found by schemathesis: an item's type that is not a string."""
    reply = httpx.post(f"{stack.urls[0]}/v1/responses", json={"input": [item]}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input", reply.text
