"""Cancellation frees the worker: with one slot, a cancelled request lets the next one run."""
import httpx
import pytest

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack, stream_events


@pytest.fixture(scope="module")
def one_slot(redis_url, tiny_llama, tmp_path_factory):
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("one-slot"), batch_size=1) as running:
        yield running


def test_cancel_frees_the_worker_for_the_next_request(one_slot):
    api = one_slot.urls[0]
    with httpx.Client(timeout=60) as client:
        # Long enough that it cannot finish before we cancel it: the context (256) bounds it.
        long = submit(client, api, prompt="Go", max_tokens=250, ignore_eos=True)["id"]
        first = stream_events(client, "GET", f"{api}/v1/requests/{long}/events", stop_after=1)
        assert first[-1]["event"] == "token"
        waiting = submit(client, api, prompt="Next", max_tokens=5, ignore_eos=True)["id"]
        assert client.get(f"{api}/v1/requests/{waiting}").json()["status"] == "queued"

        reply = client.delete(f"{api}/v1/requests/{long}")
        assert reply.status_code == 200 and reply.json()["status"] == "cancelling"
        events = stream_events(client, "GET", f"{api}/v1/requests/{long}/events")
        final = events[-1]["data"]
        assert final["status"] == "cancelled" and final["finish_reason"] == "cancelled"
        assert final["usage"]["completion_tokens"] < 250

        state = wait_done(client, api, waiting)
        assert state["status"] == "done" and state["completion_tokens"] == 5


def test_cancel_of_a_queued_request_is_immediate(one_slot):
    api = one_slot.urls[0]
    with httpx.Client(timeout=60) as client:
        busy = submit(client, api, prompt="Busy", max_tokens=250, ignore_eos=True)["id"]
        stream_events(client, "GET", f"{api}/v1/requests/{busy}/events", stop_after=1)
        queued = submit(client, api, prompt="Never runs", max_tokens=5)["id"]
        reply = client.delete(f"{api}/v1/requests/{queued}")
        assert reply.status_code == 200 and reply.json()["status"] == "cancelled"
        state = client.get(f"{api}/v1/requests/{queued}").json()
        assert state["status"] == "cancelled" and state["completion_tokens"] == 0
        assert client.delete(f"{api}/v1/requests/{busy}").status_code == 200
        assert wait_done(client, api, busy)["status"] == "cancelled"
        # The queued one was never run: its log holds only the final event.
        events = stream_events(client, "GET", f"{api}/v1/requests/{queued}/events")
        assert [e["event"] for e in events] == ["final"]
