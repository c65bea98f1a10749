"""Queue timeouts and backpressure, with real processes on the null backend."""
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack, stream_events


@pytest.fixture(scope="module")
def busy(redis_url, tiny_llama, tmp_path_factory):
    """One worker with one slot, tokens at 5/s; requests queue behind whatever runs."""
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "5", "STREAMQ_BATCH_SIZE": "1",
           "STREAMQ_MAX_QUEUED_REQUESTS": "3", "STREAMQ_QUEUE_TIMEOUT_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("busy"), env=env, scheduler=True) as stack:
        yield stack


def _occupy(client, api) -> str:
    """Start a long request and wait until it runs: it holds the only slot."""
    rid = submit(client, api, prompt="hold", max_tokens=200)["id"]
    stream_events(client, "GET", f"{api}/v1/requests/{rid}/events", stop_after=1)
    return rid


def test_a_request_waiting_past_its_timeout_expires_and_never_runs(busy):
    api = busy.urls[0]
    with httpx.Client(timeout=60) as client:
        holder = _occupy(client, api)
        waiting = submit(client, api, prompt="too late", max_tokens=3)["id"]
        events = stream_events(client, "GET", f"{api}/v1/requests/{waiting}/events")
        assert [e["event"] for e in events] == ["final"]
        final = events[0]["data"]
        assert final["status"] == "expired" and final["finish_reason"] == "expired"
        assert "timeout" in final["error"] and final["usage"]["completion_tokens"] == 0
        assert client.delete(f"{api}/v1/requests/{holder}").status_code == 200
        assert wait_done(client, api, holder)["status"] == "cancelled"
        # The worker reads the expired entry later and skips it: it stays expired, with no tokens.
        after = submit(client, api, prompt="next", max_tokens=2)["id"]
        assert wait_done(client, api, after)["status"] == "done"
        state = client.get(f"{api}/v1/requests/{waiting}").json()
        assert state["status"] == "expired" and state["completion_tokens"] == 0


def test_backlog_past_the_limit_gets_503_with_retry_after(busy):
    api = busy.urls[0]
    with httpx.Client(timeout=60) as client:
        holder = _occupy(client, api)
        queued = [submit(client, api, prompt=f"q{i}", max_tokens=2)["id"] for i in range(3)]
        refused = client.post(f"{api}/v1/requests", json={"prompt": "one too many", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert "3 requests are waiting" in refused.json()["detail"]
        chat = client.post(f"{api}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "overloaded"
        assert "Retry-After" in chat.headers
        # Everything accepted completes (or expires, since the test's queue timeout is 1 s): no 5xx.
        client.delete(f"{api}/v1/requests/{holder}")
        for rid in queued:
            assert wait_done(client, api, rid)["status"] in ("done", "expired")


def test_long_poll_answers_at_the_next_change(busy):
    api = busy.urls[0]
    with httpx.Client(timeout=60) as client:
        holder = _occupy(client, api)
        first = client.get(f"{api}/v1/requests/{holder}").json()
        later = client.get(f"{api}/v1/requests/{holder}", params={"wait": 30}).json()
        assert later["completion_tokens"] > first["completion_tokens"]  # it answered at a new token
        assert client.get(f"{api}/v1/requests/{holder}", params={"wait": 999}).status_code == 422
        client.delete(f"{api}/v1/requests/{holder}")
        assert wait_done(client, api, holder)["status"] == "cancelled"


@pytest.fixture(scope="module")
def undrained(redis_url, tiny_llama, tmp_path_factory):
    """Two api replicas with a backlog limit of 4, and no worker taking requests (it is killed
    once the replicas are ready), so nothing drains the queue."""
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_BATCH_SIZE": "2", "STREAMQ_MAX_QUEUED_REQUESTS": "4"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("undrained"), replicas=2, env=env) as stack:
        stack.kill_worker(stack.worker_name(0))
        yield stack


def test_replicas_together_queue_exactly_the_backlog_limit(undrained):
    together = threading.Barrier(60)

    def post(i: int) -> httpx.Response:
        api = undrained.urls[i % 2]
        with httpx.Client(timeout=60) as client:
            assert client.get(f"{api}/healthz").status_code == 200  # connected before the race
            together.wait(60)
            return client.post(f"{api}/v1/requests", json={"prompt": f"p{i}", "max_tokens": 2})

    with ThreadPoolExecutor(60) as pool:
        replies = list(pool.map(post, range(60)))
    accepted = [r for r in replies if r.status_code == 202]
    assert len(accepted) == 4, f"{len(accepted)} of 60 accepted with a backlog limit of 4"
    assert all(r.status_code == 503 for r in replies if r.status_code != 202)
    assert all(1 <= int(r.headers["Retry-After"]) <= 60 for r in replies if r.status_code == 503)
    assert undrained.queued() == 4  # entries ever written to the request streams
    assert len(undrained.records()) == 4  # nothing left behind by the refused ones
