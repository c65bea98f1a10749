"""Structured outputs through the whole stack (api replicas, Redis, a worker on the tiny llama
model), with the official openai client: response_format, vLLM's structured_outputs, the
native field, streaming, and the 400s."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.helpers import submit, wait_done


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=99_999_999)
    capital: bool
    region: Literal["north", "south"]


SCHEMA = {**City.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode has it
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


def test_parse_with_a_pydantic_model_gives_a_valid_instance(client, model):
    reply = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=City, max_tokens=200,
                                          temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content


def test_json_schema_on_chat_and_completions(client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format,
                                          max_tokens=200, temperature=0.9, seed=3)
    completion = client.completions.create(model=model, prompt="A city:", max_tokens=200, temperature=0,
                                           extra_body={"response_format": response_format})
    replies = ((chat.choices[0], chat.choices[0].message.content), (completion.choices[0], completion.choices[0].text))
    for choice, text in replies:
        assert choice.finish_reason == "stop"
        City.model_validate_json(text)


def test_json_object_is_an_object_as_far_as_it_goes(client, model):
    """Any object: the tiny model's random weights may write a string key until max_tokens; what
    it writes is still an object's beginning, and a finished one parses."""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                          max_tokens=60, temperature=0)
    choice = chat.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length"


def test_vllm_structured_outputs_regex_choice_and_grammar(client, model):
    def complete(constraint: dict) -> str:
        return client.completions.create(model=model, prompt="Answer:", max_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": constraint}).choices[0].text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", complete({"regex": r"[0-9]{3}-[a-z]{2}"}))
    assert complete({"choice": ["Paris", "Seoul"]}) in ("Paris", "Seoul")
    assert complete({"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")


def test_a_streamed_constrained_reply_adds_up_to_valid_json(client, model):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    City.model_validate_json(text)


def test_the_native_api_takes_the_same_constraint(stack):
    url = stack.urls[1]  # the other replica
    with httpx.Client(timeout=60) as http:
        accepted = submit(http, url, prompt="A city:", max_tokens=200, temperature=0,
                          structured_outputs={"json": SCHEMA})
        state = wait_done(http, url, accepted["id"])
        assert state["status"] == "done" and state["finish_reason"] == "stop"
        City.model_validate_json(state["text"])
        refused = http.post(f"{url}/v1/requests", json={"prompt": "x", "structured_outputs": {"regex": "[0-9"}})
    assert refused.status_code == 422 and "regex" in refused.text


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
])
def test_a_constraint_that_does_not_compile_is_400_naming_the_field(client, model, body, param, words):
    for call in (lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=body),
                 lambda: client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == param and words in info.value.body["message"], info.value.body


def test_free_and_constrained_requests_together_each_get_their_own(client, model):
    """Both kinds in the worker's batch at once: the free one is the same as when alone."""
    def free() -> str:
        return client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
    alone = free()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.completions.create, model=model, prompt="Once upon", max_tokens=200,
                                   temperature=0, extra_body={"structured_outputs": {"json": SCHEMA}})
                       for _ in range(3)]
        together = pool.submit(free)
        assert together.result() == alone
        for future in constrained:
            City.model_validate_json(future.result().choices[0].text)
