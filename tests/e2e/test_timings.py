"""The poll's timings tell the time in the Redis queue (until a worker claims the request) from
the time until its first step: a worker with no free slot may claim a request and hold it."""
import httpx
import pytest

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack, stream_events


@pytest.fixture(scope="module")
def one_slot(redis_url, tiny_llama, tmp_path_factory):
    """One worker with one slot on the null backend, tokens at 5/s."""
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "5", "STREAMQ_BATCH_SIZE": "1"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("timings"), env=env) as stack:
        yield stack


def test_a_request_claimed_behind_a_full_batch_is_scheduled_when_the_slot_frees(one_slot):
    api = one_slot.urls[0]
    with httpx.Client(timeout=60) as client:
        holder = submit(client, api, prompt="hold", max_tokens=200)["id"]
        stream_events(client, "GET", f"{api}/v1/requests/{holder}/events", stop_after=1)
        # Another lane (its priority), so the busy worker claims its head for a fair choice later.
        rid = submit(client, api, prompt="next", max_tokens=2, priority=-1)["id"]
        state = client.get(f"{api}/v1/requests/{rid}").json()
        while state["status"] == "queued":
            state = client.get(f"{api}/v1/requests/{rid}", params={"wait": 10}).json()
        assert state["status"] == "running" and state["completion_tokens"] == 0
        assert state["timings"]["queue_s"] >= 0 and state["timings"]["scheduled_s"] is None  # claimed, not run
        assert client.delete(f"{api}/v1/requests/{holder}").status_code == 200
        done, held = wait_done(client, api, rid), wait_done(client, api, holder)
    assert done["status"] == "done" and held["status"] == "cancelled"
    t = done["timings"]
    assert t["queue_s"] < t["scheduled_s"] <= t["ttft_s"] <= t["total_s"]
    # Its first step came after the holder's first token, although it was claimed while the holder ran.
    holder_first_token = held["timings"]["created_at"] + held["timings"]["ttft_s"]
    assert t["created_at"] + t["scheduled_s"] > holder_first_token
