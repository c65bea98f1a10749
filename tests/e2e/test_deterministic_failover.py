"""Exact across a crash: a worker killed with SIGKILL mid-stream, and every request's continuation
on the other worker is the undisturbed run's, token for token, greedy and seeded. The takeover
prefills prompt + delivered tokens in one forward, where the undisturbed run decoded them one at
a time, among other requests (docs/reliability.md). By default, in the dtype `auto` picks (where
the workers compute each token alone: not bf16 on a CPU with AMX), and in deterministic mode in
bf16."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.stack import Stack, stream_posted

LONG = " ".join(["the capital of France is Paris and streams batches caches"] * 6)  # a prefill over 32 tokens
PROMPTS = ["Once", "The capital of France is", LONG, "a b c", "Seoul and Paris", LONG[:90], "streams", "🚀"]
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 7}]
TOKENS = 120
MODES = {"default": {}, "deterministic bf16": {"STREAMQ_DTYPE": "bfloat16", "STREAMQ_DETERMINISTIC": "true"}}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_continuation_after_kill_9_is_the_undisturbed_run(redis_url, tiny_llama, tmp_path, mode):
    env = {**mode, "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
           "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    asks = [(prompt, sampling) for prompt in PROMPTS for sampling in SAMPLINGS]
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=True, env=env) as stack, \
            httpx.Client(timeout=120) as client:
        api = stack.urls[0]
        workers = client.get(f"{api}/v1/cluster").json()["workers"]
        assert workers and all(w["deterministic"] == ("STREAMQ_DETERMINISTIC" in mode) for w in workers)
        if not all(w["batch_invariant"] for w in workers):
            assert "STREAMQ_DETERMINISTIC" not in mode, workers  # the mode always computes each token alone
            pytest.skip("the default dtype's projections depend on the batch on this CPU (bf16 with AMX)")
        started = threading.Event()
        watched: list[str] = []

        def watch(request_id: str) -> None:
            if not started.is_set():
                stack.pause_workers()  # at its first token: no worker can finish it before the kill
                watched.append(request_id)
                started.set()

        def run(prompt: str, sampling: dict, watching: bool) -> list[int]:
            body = {"prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True, "stream": True, **sampling}
            events = stream_posted(client, f"{api}/v1/requests", body, 1, watch if watching else None)
            tokens = [e for e in events if e["event"] == "token"]
            assert [int(e["id"]) for e in tokens] == list(range(TOKENS))  # none lost, none twice
            return [e["data"]["token_id"] for e in tokens]

        with ThreadPoolExecutor(len(asks)) as pool:  # undisturbed, all at once
            undisturbed = list(pool.map(lambda ask: run(*ask, watching=False), asks))
        with ThreadPoolExecutor(len(asks)) as pool:  # again, and a worker dies mid-stream
            futures = [pool.submit(run, *ask, watching=True) for ask in asks]
            assert started.wait(60)
            running = client.get(f"{api}/v1/requests/{watched[0]}").json()
            assert running["status"] == "running", running
            victim = running["worker"]
            stack.kill_paused_worker(victim)
            continued = [f.result() for f in futures]
        taken_over = client.get(f"{api}/v1/requests/{watched[0]}").json()
        assert taken_over["status"] == "done" and taken_over["worker"] != victim  # continued elsewhere
    for ask, before, after in zip(asks, undisturbed, continued):
        assert after == before, ask
