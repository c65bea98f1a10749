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


def test_the_openai_client_runs_a_batch_from_a_file_and_reads_its_output_file(with_scheduler):
    """files.create -> batches.create(input_file_id) -> batches.retrieve -> files.content, unchanged."""
    import json

    import openai

    api = with_scheduler.urls[0]
    client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0)
    lines = [{"custom_id": f"f{i}", "method": "POST", "url": "/v1/chat/completions", "body": _chat(i)}
             for i in range(3)]
    upload = client.files.create(file=("requests.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.input_file_id == upload.id and batch.status == "validating"
    with httpx.Client(timeout=60) as http:
        batch_results(http, api, batch.model_dump())
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id and batch.error_file_id is None
    assert batch.request_counts.total == 3 and batch.request_counts.completed == 3
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == ["f0", "f1", "f2"]
    with httpx.Client(timeout=60) as http:
        for line in output:
            i = int(line["custom_id"][1:])
            direct = http.post(f"{api}/v1/chat/completions", json=_chat(i)).json()
            assert line["response"]["body"]["choices"][0]["message"]["content"] == \
                direct["choices"][0]["message"]["content"]
    listed = {f.id for f in client.files.list()}
    assert {upload.id, batch.output_file_id} <= listed
    assert client.files.delete(upload.id).deleted
