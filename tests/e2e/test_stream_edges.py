"""The api's edges on a real stack (two api replicas, a worker, Redis): an id spelt otherwise than
the server writes it is no id (404 at once, in each protocol's body), a stream of an unknown or
expired id is a 404 and never an open stream, and a tenant's open streams are capped over every
replica, each freed when its stream ends, its client leaves or its replica dies."""
from __future__ import annotations

import contextlib

import httpx
import pytest

from shared import redis_keys
from tests.e2e.helpers import response_request_id, submit, wait_done
from tests.stack import Stack
from tests.waiting import until_sync

CAP = 2


@pytest.fixture(scope="module")
def stack(redis_url, tiny_llama, tmp_path_factory):
    env = {"STREAMQ_MAX_STREAMS_PER_TENANT": str(CAP), "STREAMQ_STREAM_LEASE_S": "2"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("edges"), replicas=2, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def _spellings(real: str) -> list[str]:
    """Other spellings of a real id, as a path segment (URL-encoded)."""
    head, sep, tail = real.rpartition("_")
    return [real.upper(), f"{head}{sep}{tail.upper()}" if sep else real[:-1] + "F", f"%20{real}", f"{real}%20",
            f"%7B{real}%7D", f"urn:uuid:{real}", f"{real}%0A"]


def _status_of_stream(client: httpx.Client, method: str, url: str, **kwargs) -> tuple[int, dict | None]:
    """The status a stream is answered with, and its JSON body unless it streams (it is left at once)."""
    with client.stream(method, url, **kwargs) as reply:
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            return reply.status_code, None
        return reply.status_code, reply.read() and reply.json()


def _open_streams(stack: Stack) -> int:
    with stack.redis() as redis:
        return redis.zcard(redis_keys.tenant_streams(stack.prefix, ""))  # with auth off every caller is ""


def test_another_spelling_of_a_request_id_is_not_found_at_once(stack, client):
    api = stack.urls[0]
    rid = submit(client, api, prompt="Once", max_tokens=4, temperature=0)["id"]
    assert wait_done(client, api, rid)["completion_tokens"] == 4
    for other in _spellings(rid):
        base = f"{api}/v1/requests/{other}"
        assert client.get(base).status_code == 404, other
        status, body = _status_of_stream(client, "GET", f"{base}/events")
        assert status == 404 and body["detail"].startswith("no request"), other
        assert client.delete(base).status_code == 404, other
    assert client.get(f"{api}/v1/requests/{rid}").json()["completion_tokens"] == 4


def _decoded(segment: str) -> str:
    return httpx.URL(f"http://x/{segment}").path[1:]


def test_a_stream_of_an_unknown_or_expired_request_is_not_found(stack, client):
    api = stack.urls[1]
    never = "0b6a5a8e-1234-4abc-9def-000000000001"  # well formed, never made
    assert _status_of_stream(client, "GET", f"{api}/v1/requests/{never}/events")[0] == 404
    rid = submit(client, api, prompt="Once", max_tokens=3)["id"]
    wait_done(client, api, rid)
    with stack.redis() as redis:  # expired: its record and token log gone, as their TTL does it
        redis.delete(redis_keys.request_record(stack.prefix, rid), redis_keys.token_log(stack.prefix, rid))
    assert _status_of_stream(client, "GET", f"{api}/v1/requests/{rid}/events")[0] == 404
    assert client.get(f"{api}/v1/requests/{rid}").status_code == 404


def _openai_not_found(reply: httpx.Response) -> bool:
    return reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


def test_another_spelling_of_a_response_or_batch_id_is_not_found(stack, client):
    api = stack.urls[0]
    created = client.post(f"{api}/v1/responses", json={"input": "Once", "max_output_tokens": 3})
    response_id = created.json()["id"]
    batch = client.post(f"{api}/v1/batches", json={"endpoint": "/v1/completions", "requests": [
        {"custom_id": "a", "body": {"prompt": "x", "max_tokens": 2}}]}).json()
    for other in _spellings(response_id):
        base = f"{api}/v1/responses/{other}"
        replies = [client.get(base), client.get(f"{base}/input_items"), client.post(f"{base}/cancel"),
                   client.delete(base), client.post(f"{api}/v1/responses", json={"input": "x",
                                                                              "previous_response_id": _decoded(other)})]
        assert all(_openai_not_found(r) for r in replies), (other, [r.text for r in replies])
        status, body = _status_of_stream(client, "GET", base, params={"stream": "true", "starting_after": 0})
        assert status == 404 and body["error"]["code"] == "not_found", other
    for other in _spellings(batch["id"]):
        assert _openai_not_found(client.get(f"{api}/v1/batches/{other}")), other
        assert _openai_not_found(client.get(f"{api}/v1/batches/{other}/results")), other
    assert client.get(f"{api}/v1/responses/{response_id}").status_code == 200  # the id as written: found
    assert client.get(f"{api}/v1/batches/{batch['id']}").status_code == 200


def test_a_response_whose_request_is_gone_is_not_found_and_never_an_open_stream(stack, client):
    api = stack.urls[1]
    response_id = client.post(f"{api}/v1/responses", json={"input": "Once", "max_output_tokens": 3}).json()["id"]
    request_id = response_request_id(stack, response_id)
    with stack.redis() as redis:
        redis.delete(redis_keys.request_record(stack.prefix, request_id), redis_keys.token_log(stack.prefix, request_id))
    status, body = _status_of_stream(client, "GET", f"{api}/v1/responses/{response_id}", params={"stream": "true"})
    assert status == 404 and body["error"]["code"] == "not_found"
    assert _openai_not_found(client.get(f"{api}/v1/responses/{response_id}"))
    assert client.delete(f"{api}/v1/responses/{response_id}").json()["deleted"] is True


def _refusals(client: httpx.Client, api: str, rid: str, model: str) -> dict[str, httpx.Response]:
    """A new stream on every protocol, each at the cap: the replies (each read whole)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    calls = {"native events": ("GET", f"/v1/requests/{rid}/events", None),
             "native submit": ("POST", "/v1/requests", {"prompt": "x", "max_tokens": 2, "stream": True}),
             "seed": ("POST", "/generate_stream", {"prompt": "x"}),
             "chat": ("POST", "/v1/chat/completions", chat),
             "completions": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
             "messages": ("POST", "/v1/messages", chat),
             "responses": ("POST", "/v1/responses", {"input": "x", "max_output_tokens": 2, "stream": True})}
    return {name: client.request(method, f"{api}{path}", json=body) for name, (method, path, body) in calls.items()}


def _streams(client: httpx.Client, urls: list[str]) -> contextlib.ExitStack:
    """Streams opened (answered 200, then left unread while the block runs)."""
    opened = contextlib.ExitStack()
    for url in urls:
        reply = opened.enter_context(client.stream("GET", url))
        assert reply.status_code == 200, reply.read()
    return opened


def test_a_tenant_s_streams_are_capped_over_every_replica_and_a_client_leaving_frees_its_slot(stack, client):
    first, second = stack.urls
    records = len(stack.records())
    stack.pause_workers()  # the request stays queued: its streams stay open
    try:
        rid = submit(client, first, prompt="x", max_tokens=2)["id"]
        with _streams(client, [f"{first}/v1/requests/{rid}/events", f"{second}/v1/requests/{rid}/events"]):
            assert _open_streams(stack) == CAP
            model = stack.model_name
            refused = _refusals(client, first, rid, model) | {f"{k} (second)": v for k, v in
                                                            _refusals(client, second, rid, model).items()}
            assert {name: r.status_code for name, r in refused.items()} == {name: 429 for name in refused}
            for name, reply in refused.items():
                body = reply.json()
                if name.startswith(("native", "seed")):
                    assert "streams open" in body["detail"], body
                elif name.startswith("messages"):
                    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
                else:
                    assert body["error"]["type"] == "rate_limit_error", body
                    assert body["error"]["code"] == "rate_limit_exceeded", body
            assert len(stack.records()) == records + 1  # a refused stream queued nothing
        until_sync(lambda: _open_streams(stack) == 0, 30, "the streams' slots freed by their clients leaving")
        with _streams(client, [f"{second}/v1/requests/{rid}/events", f"{first}/v1/requests/{rid}/events"]):
            assert _open_streams(stack) == CAP
    finally:
        stack.resume_workers()
    until_sync(lambda: _open_streams(stack) == 0, 30, "the slots freed")


def test_a_stream_that_ends_frees_its_slot(stack, client):
    api = stack.urls[0]
    stack.pause_workers()
    try:
        rid = submit(client, api, prompt="x", max_tokens=3)["id"]
        with client.stream("GET", f"{api}/v1/requests/{rid}/events") as reply:
            assert reply.status_code == 200 and _open_streams(stack) == 1
            stack.resume_workers()
            lines = list(reply.iter_lines())  # to its end: the server ends it after the final event
            assert "event: final" in lines
            until_sync(lambda: _open_streams(stack) == 0, 30, "the ended stream's slot freed")
    finally:
        stack.resume_workers()


def test_a_killed_replica_s_streams_free_their_slots_after_their_lease(stack, client):
    """Last in the module: it kills the second replica."""
    first, second = stack.urls
    stack.pause_workers()
    try:
        rid = submit(client, first, prompt="x", max_tokens=2)["id"]
        with _streams(client, [f"{second}/v1/requests/{rid}/events", f"{second}/v1/requests/{rid}/events"]):
            assert _open_streams(stack) == CAP
            assert _status_of_stream(client, "GET", f"{first}/v1/requests/{rid}/events")[0] == 429
            stack.kill_replica(1)  # its streams die with it, and nothing frees their slots but their lease
            until_sync(lambda: _open_streams(stack) == 0, 30, "a dead replica's slots lapsing")
        with _streams(client, [f"{first}/v1/requests/{rid}/events"] * CAP):
            assert _open_streams(stack) == CAP
    finally:
        stack.resume_workers()
