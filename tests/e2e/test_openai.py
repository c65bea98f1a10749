"""The official openai client against a live stack (tiny llama model, two replicas)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from api.openai.answers import ChatCompletion, Completion, ErrorDetail, ModelList
from shared.messages import FinishReason, RequestStatus
from shared.tokenizer import Tokenizer
from tests.e2e.helpers import hf_greedy


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]
    ModelList.model_validate(client.models.with_raw_response.list().http_response.json())


def test_completion_greedy_equals_transformers(client, model, tiny_llama):
    reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    tok = Tokenizer(tiny_llama)
    expected = hf_greedy(tiny_llama, tok.encode("Once upon a time"), 12)
    assert reply.object == "text_completion" and reply.choices[0].text == tok.decode(expected)
    assert reply.usage.completion_tokens == len(expected) and reply.usage.prompt_tokens == len(tok.encode("Once upon a time"))
    assert reply.choices[0].finish_reason in ("stop", "length")
    Completion.model_validate(reply.to_dict())


def test_completion_stream_adds_up_and_reports_usage(client, model):
    plain = client.completions.create(model=model, prompt="Seoul", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model, prompt="Seoul", max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_several_prompts_in_one_completion_in_every_form(client, model, tiny_llama):
    tok = Tokenizer(tiny_llama)
    texts = ["Seoul", "Once upon a time", "The"]
    alone = [client.completions.create(model=model, prompt=t, max_tokens=6, temperature=0) for t in texts]
    for prompt in (texts, [tok.encode(t) for t in texts]):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, n=2)
        Completion.model_validate(reply.to_dict())
        assert [c.index for c in reply.choices] == list(range(6))  # prompt by prompt, n each
        assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert reply.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.completions.create(model=model, prompt=texts, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert chunks[-1].usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ranked = client.completions.create(model=model, prompt=texts[:2], max_tokens=6, temperature=1, seed=3, n=1, best_of=3)
    assert [c.index for c in ranked.choices] == [0, 1]


@pytest.mark.parametrize("prompt, words", [([], "at least one prompt"), ([[1], []], "at least one token"),
                                           ([[1], [10 ** 6]], "vocabulary"), (["a"] * 65, "at most 64 prompts times samples"),
                                           (["a", 1], "prompt")])
def test_bad_prompt_forms_are_400s(client, model, prompt, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.completions.create(model=model, prompt=prompt, max_tokens=2)


def test_chat_n_samples_with_seed_logprobs(client, model):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=1.0, seed=7, n=3, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    ChatCompletion.model_validate(reply.to_dict())
    assert reply.usage.completion_tokens == 24
    for choice in reply.choices:
        assert choice.message.role == "assistant"
        assert len(choice.logprobs.content) == 8
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_chat_stream_with_the_async_client(stack, model):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{stack.urls[1]}/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                      max_tokens=6, temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        await client.close()
        return chunks

    chunks = asyncio.run(go())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].delta.content) <= 6


def test_best_of_returns_the_most_likely(client, model):
    """best_of=3 runs the same three seeded samples as n=3 (sample i gets the request's seed + i):
    the one it returns is the candidate with the highest cumulative logprob."""
    common = dict(model=model, prompt="a b", max_tokens=5, temperature=1.0, seed=3, logprobs=0)
    reply = client.completions.create(n=1, best_of=3, **common)
    candidates = client.completions.create(n=3, **common).choices
    totals = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = max(range(3), key=totals.__getitem__)
    assert len({c.text for c in candidates}) > 1, "the samples must differ for the ranking to mean anything"
    assert best != 0, "with sample 0 the best, returning the first sample would pass too: pick another seed"
    assert len(reply.choices) == 1
    chosen = reply.choices[0]
    assert chosen.text == candidates[best].text
    assert sum(chosen.logprobs.token_logprobs) == pytest.approx(totals[best])
    assert all(totals[best] > t + 1e-6 for i, t in enumerate(totals) if i != best)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_bad_input_gets_openai_errors(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", **kwargs)
    body = info.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]
    ErrorDetail.model_validate(body)


def test_unknown_model_is_404_with_the_served_list(client, model):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert model in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_prompt_past_the_context_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="word " * 300, max_tokens=4)
    assert "256" in info.value.body["message"]


def test_streaming_client_that_disconnects_cancels(stack, model):
    api = stack.urls[0]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{api}/v1/completions", json={
                "model": model, "prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    break
    record = stack.wait_for_record(lambda r: '"max_tokens":200' in (r.params or "") and r.status != RequestStatus.RUNNING)
    assert (record.status, record.finish_reason) == (RequestStatus.CANCELLED, FinishReason.CANCELLED)


@pytest.mark.parametrize("argument", [{"functions": [{"name": "f"}]}, {"function_call": "auto"}, {"frobnicate": 1}])
def test_an_argument_that_is_not_implemented_is_400_naming_it(client, model, argument):
    name = next(iter(argument))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body=argument)
    assert info.value.body["param"] == name and name in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=argument)
    assert info.value.body["param"] == name


def test_arguments_that_change_no_token_are_ignored_and_backend_is_honoured(client, model):
    def text(**extra) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, **extra)
        return reply.choices[0].message.content

    plain = text()
    assert text(user="u", metadata={"k": "v"}, store=False, service_tier="auto") == plain
    assert text(extra_body={"backend": "hf"}) == plain
    with pytest.raises(openai.NotFoundError) as info:
        text(extra_body={"backend": "vllm"})
    assert info.value.body["code"] == "backend_not_found" and info.value.body["param"] == "backend"
