"""Redis killed (SIGKILL) and restarted under load, with AOF and appendfsync always: the worker
and the api reconnect and do not crash; every open stream pauses and then completes, on the
same connection, with its exact greedy text."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from shared.redis_server import RedisServer
from shared.tokenizer import Tokenizer
from tests.e2e.helpers import events_of, hf_greedy
from tests.stack import Stack, parse_sse, stream_events

PROMPTS = ["Once", "The capital of France is", "a b c", "Seoul"]
TOKENS = 150


def test_streams_survive_a_redis_restart(tiny_llama, tmp_path):
    redis = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    url = redis.start()
    try:
        with Stack(url, tiny_llama, tmp_path / "stack", env={"STREAMQ_NUM_KV_BLOCKS": "512"}) as stack, \
                httpx.Client(timeout=120) as client:
            api = stack.urls[0]
            flowing = {prompt: threading.Event() for prompt in PROMPTS}

            def run(prompt: str) -> tuple[str, list[dict]]:
                body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                reply = client.post(f"{api}/v1/requests", json=body)
                rid = reply.json()["id"]
                events, lines = [], []
                with client.stream("GET", f"{api}/v1/requests/{rid}/events") as stream:
                    for line in stream.iter_lines():
                        lines.append(line)
                        if line == "":
                            events += parse_sse(lines)
                            lines = []
                            if sum(e["event"] == "token" for e in events) >= 3:
                                flowing[prompt].set()
                            if events and events[-1]["event"] == "final":
                                return rid, events
                return rid, events

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(run, p) for p in PROMPTS]
                assert all(flowing[p].wait(60) for p in PROMPTS)  # every stream open and mid-way
                redis.crash_and_restart()
                results = [f.result() for f in futures]

            tok = Tokenizer(tiny_llama)
            for prompt, (_rid, events) in zip(PROMPTS, results):
                assert events[-1]["event"] == "final", prompt  # the stream waited for Redis, never broke
                tokens = [e for e in events if e["event"] == "token"]
                assert [int(e["id"]) for e in tokens] == list(range(TOKENS)), prompt
                assert [e["data"]["token_id"] for e in tokens] == hf_greedy(
                    tiny_llama, tok.encode(prompt), TOKENS, ignore_eos=True), prompt
            for name, proc in stack.processes:
                assert proc.poll() is None, f"{name} died"  # they reconnected (redis-py may retry unseen)
            # And they still serve: a new request after the restart completes.
            after = client.post(f"{api}/v1/requests", json={"prompt": "after", "max_tokens": 3}).json()["id"]
            assert events_of(client, api, after)[-1]["data"]["status"] == "done"
    finally:
        redis.stop()


def test_a_worker_outlives_a_redis_outage_longer_than_its_stall_limit(tiny_llama, tmp_path):
    """A worker waiting for Redis is not a stuck engine: with engine_stall_s=1, Redis away for
    longer than that (the worker's retries back off to 1.6 s) leaves the worker running, and its
    stream completes once Redis is back."""
    redis = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    url = redis.start()
    env = {"STREAMQ_ENGINE_STALL_S": "1", "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
           "STREAMQ_NULL_TOKENS_PER_S": "20", "STREAMQ_BACKEND": "null"}
    try:
        with Stack(url, tiny_llama, tmp_path / "stack", env=env) as stack, httpx.Client(timeout=120) as client:
            api = stack.urls[0]
            rid = client.post(f"{api}/v1/requests", json={"prompt": "x", "max_tokens": 100}).json()["id"]
            stream_events(client, "GET", f"{api}/v1/requests/{rid}/events", stop_after=3)
            redis.kill()
            log = stack.folder / "worker0.log"
            deadline = time.monotonic() + 60
            while "retrying in 1.6 s" not in log.read_text(errors="replace"):  # its wait is past 1.5 s
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.05)  # re-reading the worker's log, not ordering events
            redis.start()
            final = events_of(client, api, rid)[-1]["data"]
            assert final["status"] == "done" and final["usage"]["completion_tokens"] == 100
            worker = dict(stack.processes)["worker0"]
            assert worker.poll() is None, stack.logs()
            assert "withdrawing this worker" not in log.read_text(errors="replace")
    finally:
        redis.stop()
