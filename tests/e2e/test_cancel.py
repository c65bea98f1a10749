"""Cancellation frees the worker: with one slot, a cancelled request lets the next one run.

The worker is paused (SIGSTOP) while the test looks at the queue, so what it sees does not hang
on how fast the model runs: a long request stays running, and the next one stays queued."""
import httpx
import pytest

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack, stream_events
from streamq.testing.tiny_models import build_model

CONTEXT = 4096
LONG = CONTEXT - 16  # far more steps than the test takes to pause the worker after the first token


@pytest.fixture(scope="module")
def one_slot(redis_url, tmp_path_factory):
    model = build_model(tmp_path_factory.mktemp("tiny-llama-4k"), "llama", context=CONTEXT)
    # A paused worker misses heartbeats; a long time-to-live keeps it live in the registry meanwhile.
    env = {"STREAMQ_HEARTBEAT_TTL_S": "120"}
    with Stack(redis_url, model, tmp_path_factory.mktemp("one-slot"), batch_size=1, env=env) as running:
        yield running


def _start_and_pause(stack: Stack, client: httpx.Client, prompt: str) -> str:
    """Submit a long request, pause the worker once it has streamed a token, and return its id."""
    api = stack.urls[0]
    long = submit(client, api, prompt=prompt, max_tokens=LONG, ignore_eos=True)["id"]
    first = stream_events(client, "GET", f"{api}/v1/requests/{long}/events", stop_after=1)
    assert first[-1]["event"] == "token"
    stack.pause_worker()
    assert client.get(f"{api}/v1/requests/{long}").json()["status"] == "running"
    return long


def test_cancel_frees_the_worker_for_the_next_request(one_slot):
    api = one_slot.urls[0]
    with httpx.Client(timeout=60) as client:
        try:
            long = _start_and_pause(one_slot, client, "Go")
            waiting = submit(client, api, prompt="Next", max_tokens=5, ignore_eos=True)["id"]
            assert client.get(f"{api}/v1/requests/{waiting}").json()["status"] == "queued"
            reply = client.delete(f"{api}/v1/requests/{long}")
            assert reply.status_code == 200 and reply.json()["status"] == "cancelling"
        finally:
            one_slot.resume_worker()
        events = stream_events(client, "GET", f"{api}/v1/requests/{long}/events")
        final = events[-1]["data"]
        assert final["status"] == "cancelled" and final["finish_reason"] == "cancelled"
        assert final["usage"]["completion_tokens"] < LONG

        state = wait_done(client, api, waiting)
        assert state["status"] == "done" and state["completion_tokens"] == 5


def test_cancel_of_a_queued_request_is_immediate(one_slot):
    api = one_slot.urls[0]
    with httpx.Client(timeout=60) as client:
        try:
            busy = _start_and_pause(one_slot, client, "Busy")
            queued = submit(client, api, prompt="Never runs", max_tokens=5)["id"]
            reply = client.delete(f"{api}/v1/requests/{queued}")
            assert reply.status_code == 200 and reply.json()["status"] == "cancelled"
            state = client.get(f"{api}/v1/requests/{queued}").json()
            assert state["status"] == "cancelled" and state["completion_tokens"] == 0
            assert client.delete(f"{api}/v1/requests/{busy}").status_code == 200
        finally:
            one_slot.resume_worker()
        assert wait_done(client, api, busy)["status"] == "cancelled"
        # The queued one was never run: its log holds only the final event.
        events = stream_events(client, "GET", f"{api}/v1/requests/{queued}/events")
        assert [e["event"] for e in events] == ["final"]
