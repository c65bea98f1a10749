"""The null backend: the whole serving path without a model (used by the relay benchmark)."""
import httpx

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack, stream_events


def test_null_backend_streams_timestamps_and_cancels(redis_url, tiny_llama, tmp_path):
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "200", "STREAMQ_BATCH_SIZE": "64"}
    with Stack(redis_url, tiny_llama, tmp_path, env=env) as stack, httpx.Client(timeout=60) as client:
        api = stack.urls[0]
        events = stream_events(client, "POST", f"{api}/v1/requests",
                               json={"prompt": "x", "max_tokens": 20, "stream": True})
        tokens = [e["data"] for e in events if e["event"] == "token"]
        stamps = [float(t["text"]) for t in tokens]
        assert len(tokens) == 20 and stamps == sorted(stamps)
        assert events[-1]["data"]["usage"]["completion_tokens"] == 20
        long = submit(client, api, prompt="y", max_tokens=200)["id"]
        stream_events(client, "GET", f"{api}/v1/requests/{long}/events", stop_after=1)
        assert client.delete(f"{api}/v1/requests/{long}").status_code == 200
        state = wait_done(client, api, long)
        assert state["status"] == "cancelled" and state["completion_tokens"] < 200
