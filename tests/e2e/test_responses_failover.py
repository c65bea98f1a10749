"""Background responses lose nothing: a kill -9 of the api replica holding the stream (resumed on
the other with starting_after), of the worker running it, and a Redis restart under AOF each give,
in fp32 and greedy, exactly the text of an undisturbed run, with every sequence number once."""
from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from shared.messages import RequestStatus
from shared.redis_server import RedisServer
from tests.e2e.helpers import held_mid_response, response_request_id
from tests.stack import Stack

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell me a story"
TOKENS = 60
FAST_FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
                 "STREAMQ_RECLAIM_INTERVAL_S": "1"}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _undisturbed(client: openai.OpenAI) -> tuple[str, str]:
    reference = client.responses.create(input=PROMPT, temperature=0, max_output_tokens=TOKENS)
    assert reference.status == "incomplete"  # it runs the whole budget: long enough to be cut into
    return reference.output_text, reference.status


def _check(events: list, reference: tuple[str, str]) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))  # none lost, none twice
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference[0]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == reference[0]


@pytest.fixture(scope="module")
def stack(redis_url, tiny_llama, tmp_path_factory):
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("responses-failover"), replicas=2, workers=2,
               scheduler=True, env=FAST_FAILOVER) as running:
        yield running


def test_the_replica_holding_the_stream_killed_then_resumed_on_the_other(stack):
    """First in this module: it kills replica 0 (the next test uses replica 1)."""
    client, other = _client(stack.urls[0]), _client(stack.urls[1])
    reference = _undisturbed(other)
    created, stream, events = held_mid_response(client, stack, PROMPT, TOKENS)
    try:
        stack.kill_replica(0)
        # The dead replica's connection ends in an error, or (seen under load) as a plain end of
        # the body: either way, what it had written before it died is all it gives.
        with contextlib.suppress(httpx.HTTPError, openai.APIError):
            for event in stream:
                events.append(event)
    finally:
        stack.resume_workers()
    assert events[-1].type not in ("response.completed", "response.incomplete")  # cut mid-response
    events += list(other.responses.retrieve(created.id, stream=True, starting_after=events[-1].sequence_number))
    _check(events, reference)


def test_a_worker_killed_mid_response(stack):
    client = _client(stack.urls[1])
    reference = _undisturbed(client)
    created, stream, events = held_mid_response(client, stack, PROMPT, TOKENS)
    record = stack.record(response_request_id(stack, created.id))
    assert record.status == RequestStatus.RUNNING, record
    stack.kill_paused_worker(record.worker)
    events += list(stream)
    _check(events, reference)
    taken = stack.record(response_request_id(stack, created.id))
    assert taken.worker != record.worker  # another worker finished it: a takeover happened
    assert client.responses.retrieve(created.id).output_text == reference[0]


def test_a_redis_restart_under_aof_mid_response(tiny_llama, tmp_path):
    redis = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    url = redis.start()
    try:
        with Stack(url, tiny_llama, tmp_path / "stack") as stack:
            client = _client(stack.urls[0])
            reference = _undisturbed(client)
            created, stream, events = held_mid_response(client, stack, PROMPT, TOKENS)
            redis.crash_and_restart()
            stack.resume_worker(0)
            events += list(stream)  # the same connection: the stream waited for Redis
            _check(events, reference)
            stored = json.loads(client.responses.retrieve(created.id).model_dump_json())
            assert stored["status"] == "incomplete" and stored["output"][0]["content"][0]["text"] == reference[0]
    finally:
        redis.stop()
