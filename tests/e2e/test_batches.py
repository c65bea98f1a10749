"""Offline batches (OpenAI Batch shape): run by the scheduler, results equal direct calls."""

import httpx
import pytest

from api.openai.answers import Batch, BatchResultLine, ChatCompletion, OpenAIError
from tests.e2e.helpers import batch_results
from tests.stack import Stack


@pytest.fixture(scope="module")
def with_scheduler(redis_url, tiny_llama, tmp_path_factory):
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("batches"), scheduler=True) as stack:
        yield stack


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6, "temperature": 0}


def test_a_batch_runs_and_its_results_match_direct_calls(with_scheduler):
    api = with_scheduler.urls[0]
    with httpx.Client(timeout=60) as client:
        created = client.post(f"{api}/v1/batches", json={
            "endpoint": "/v1/chat/completions", "metadata": {"run": "t"},
            "requests": [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": _chat(i)}
                         for i in range(5)]})
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["object"] == "batch" and batch["request_counts"]["total"] == 5
        Batch.model_validate(batch)
        batch, lines = batch_results(client, api, batch)
        Batch.model_validate(batch)
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert [x["custom_id"] for x in lines] == [f"q{i}" for i in range(5)]
        for i, line in enumerate(lines):
            direct = client.post(f"{api}/v1/chat/completions", json=_chat(i)).json()
            BatchResultLine.model_validate(line)
            ChatCompletion.model_validate(direct)
            body = line["response"]["body"]
            assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            # The same counts; the direct call may find the batch's prompt in a cache (cached_tokens).
            assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
                {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_a_bad_request_fails_the_whole_batch_up_front(with_scheduler):
    api = with_scheduler.urls[0]
    with httpx.Client(timeout=60) as client:
        reply = client.post(f"{api}/v1/batches", json={"endpoint": "/v1/completions", "requests": [
            {"custom_id": "ok", "body": {"prompt": "x", "max_tokens": 2}},
            {"custom_id": "bad", "body": {"prompt": "x", "max_tokens": 9999}}]})
        assert reply.status_code == 400 and "'bad'" in reply.json()["error"]["message"]
        OpenAIError.model_validate(reply.json())
        missing = client.get(f"{api}/v1/batches/batch_nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
