"""The request path end to end: real api replicas, a real worker, a real Redis, a tiny model."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api.admin.answers import Cluster, Healthy, Ready
from api.core.openapi import Detail
from api.native.answers import RequestState, Submitted
from shared.tokenizer import Tokenizer
from tests.e2e.helpers import events_of, hf_greedy, submit, token_ids, wait_done
from tests.stack import stream_events

PROMPTS = ["Once", "The capital of France is", "안녕하세요, 반갑습니다. 😀 and then a longer tail of words here",
           "a b c", "Streams, batches and caches", "x", "Paris. The capital of Korea is Seoul. And the", "🚀🚀"]


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def test_submit_then_poll_until_done(stack, client):
    api = stack.urls[0]
    accepted = submit(client, api, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert accepted["status"] == "queued" and accepted["max_tokens"] == 12
    assert accepted["links"]["events"] == f"/v1/requests/{accepted['id']}/events"
    Submitted.model_validate(accepted)
    state = wait_done(client, api, accepted["id"])
    RequestState.model_validate(state)
    assert state["status"] == "done" and state["finish_reason"] in ("stop", "length")
    assert 1 <= state["completion_tokens"] <= 12
    assert state["prompt_tokens"] == accepted["prompt_tokens"]
    assert state["timings"]["total_s"] >= state["timings"]["ttft_s"] >= 0


def test_events_arrive_in_order_and_end_with_final(stack, client):
    api = stack.urls[0]
    rid = submit(client, api, prompt="Streams", max_tokens=20, temperature=0, ignore_eos=True)["id"]
    events = events_of(client, api, rid)
    tokens = [e for e in events if e["event"] == "token"]
    assert [int(e["id"]) for e in tokens] == list(range(20))
    assert [e["data"]["index"] for e in tokens] == list(range(20))
    assert events[-1]["event"] == "final"
    assert events[-1]["data"]["usage"]["completion_tokens"] == 20
    assert events[-1]["data"]["finish_reason"] == "length"
    assert "".join(e["data"]["text"] for e in tokens) == wait_done(client, api, rid)["text"]


def test_streamed_text_is_exact_utf8(stack, client, tiny_llama):
    tok = Tokenizer(tiny_llama)
    api = stack.urls[0]
    produced = ""
    for seed in range(6):
        events = stream_events(client, "POST", f"{api}/v1/requests",
                               json={"prompt": "안녕 😀", "max_tokens": 60, "seed": seed, "stream": True})
        tokens = [e["data"] for e in events if e["event"] == "token"]
        final_text = tok.decode([t["token_id"] for t in tokens])
        shown = ""
        for t in tokens:
            shown += t["text"]
            # A delta that cut a character in two would show U+FFFD where the final text has the
            # character: every prefix of the stream must be a prefix of the final text.
            assert final_text.startswith(shown), (shown, final_text)
        assert shown == final_text
        produced += final_text
    assert any(ord(c) > 0x7FF and c != "\ufffd" for c in produced)  # 3- and 4-byte characters were streamed


def test_resume_with_last_event_id_from_the_middle(stack, client):
    api = stack.urls[0]
    rid = submit(client, api, prompt="Resume me", max_tokens=16, temperature=0, ignore_eos=True)["id"]
    everything = events_of(client, api, rid)
    tokens = [e for e in everything if e["event"] == "token"]
    for last in (-1, 0, 7, 14, 15):
        resumed = events_of(client, api, rid, last_event_id=last)
        assert [e for e in resumed if e["event"] == "token"] == tokens[last + 1:]
        assert resumed[-1] == everything[-1]


def test_concurrent_streams_never_mix_and_match_transformers(stack, client, tiny_llama):
    """8 prompts of different lengths streamed at once: each gets exactly its own greedy tokens."""
    api = stack.urls[0]
    tok = Tokenizer(tiny_llama)

    def run(prompt):
        return stream_events(client, "POST", f"{api}/v1/requests",
                             json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    for prompt, events in zip(PROMPTS, results):
        assert token_ids(events) == hf_greedy(tiny_llama, tok.encode(prompt), 24), prompt


def test_two_replicas_submit_on_one_stream_and_poll_on_the_other(stack, client):
    first, second = stack.urls
    rid = submit(client, first, prompt="Across replicas", max_tokens=10, temperature=0, ignore_eos=True)["id"]
    events = events_of(client, second, rid)
    assert len(token_ids(events)) == 10 and events[-1]["event"] == "final"
    state = wait_done(client, second, rid)
    assert state["text"] == "".join(e["data"]["text"] for e in events if e["event"] == "token")
    assert client.get(f"{first}/v1/requests/{rid}").json() == state


def test_chat_messages_use_the_template(stack, client):
    api = stack.urls[0]
    reply = submit(client, api, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    # <s> is not added: the template writes the prompt's special tokens itself.
    tok_count = reply["prompt_tokens"]
    assert tok_count > 4
    assert wait_done(client, api, reply["id"])["status"] == "done"


def test_disconnecting_a_stream_cancels_its_request(stack, client):
    """The worker is paused from the first token until the api has published the cancel, so the
    tiny model cannot finish its 200 tokens first, however slowly a loaded machine notices the
    hang-up (leaving the read hangs up). A worker runs ahead of its client: where it ended the
    request before the pause, the test tries a new one."""
    api = stack.urls[0]
    for _ in range(5):
        paused = False
        try:
            with stack.cancel_published() as watch, client.stream(
                    "POST", f"{api}/v1/requests",
                    json={"prompt": "Go on", "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
                rid = reply.headers["X-Request-Id"]
                for line in reply.iter_lines():
                    if line.startswith("id: "):
                        stack.pause_worker()
                        paused = True
                        break  # one token arrived: hang up
                watch.expected = stack.record(rid).status == "running"
        finally:
            if paused:
                stack.resume_worker()
        if not watch.expected:
            continue
        state = wait_done(client, api, rid)
        assert state["status"] == "cancelled" and state["finish_reason"] == "cancelled"
        assert state["completion_tokens"] < 200
        return
    raise AssertionError("the request ended before its worker was paused, 5 times")


def test_detached_stream_can_leave_without_cancelling(stack, client):
    api = stack.urls[1]
    rid = submit(client, api, prompt="Keep going", max_tokens=30, ignore_eos=True)["id"]
    partial = stream_events(client, "GET", f"{api}/v1/requests/{rid}/events", stop_after=1)
    assert token_ids(partial)
    state = wait_done(client, api, rid)
    assert state["status"] == "done" and state["completion_tokens"] == 30


@pytest.mark.parametrize("body,status,needles", [
    ('{"prompt": "x", ', 422, ["json"]),
    ({"prompt": "x", "max_tokens": "many"}, 422, ["max_tokens"]),
    ({"prompt": "x", "temperature": 9}, 422, ["temperature"]),
    ({"prompt": "x", "top_p": 0}, 422, ["top_p"]),
    ({"prompt": "x", "max_tokenz": 3}, 422, ["max_tokenz"]),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 422, ["exactly one"]),
    ({}, 422, ["exactly one"]),
    ({"prompt": "word " * 300}, 400, ["the prompt has 603 tokens", "context is 256"]),
    ({"prompt": "x", "max_tokens": 300}, 400, ["max_tokens is 300", "context of 256"]),
    ({"prompt": "x", "model": "gpt-9"}, 404, ["gpt-9"]),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, 422, ["logit_bias", "99999"]),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 422, ["logit_bias"]),
    ({"prompt": "x", "logprobs": 21}, 422, ["logprobs"]),
    ({"prompt": "x", "top_k": 10**30}, 422, ["top_k"]),
    ({"prompt": "x", "top_k": 100_000}, 422, ["top_k", "vocabulary size"]),
    ({"prompt": "x", "seed": 2**70}, 422, ["seed"]),
    ({"prompt": "x", "logits_processors": [{"name": "eval", "code": "1"}]}, 422, ["logits_processors"]),
])
def test_bad_input_gets_a_clear_error_and_queues_nothing(stack, client, body, status, needles):
    api = stack.urls[0]
    queued_before = stack.queued()
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    reply = client.post(f"{api}/v1/requests", **kwargs)
    assert reply.status_code == status, reply.text
    for needle in needles:
        assert needle in reply.text.lower() or needle in reply.text
    assert stack.queued() == queued_before


@pytest.mark.parametrize("path", ["/v1/requests/5b0c2a8e-1111-4222-8333-444455556666", "/v1/requests/not-a-uuid",
                                  "/v1/requests/5b0c2a8e-1111-4222-8333-444455556666/events"])
def test_unknown_ids_are_404(stack, client, path):
    assert client.get(stack.urls[0] + path).status_code == 404
    if not path.endswith("events"):
        assert client.delete(stack.urls[0] + path).status_code == 404


def test_cancel_of_a_finished_request_is_a_conflict(stack, client):
    api = stack.urls[0]
    rid = submit(client, api, prompt="short", max_tokens=2)["id"]
    wait_done(client, api, rid)
    reply = client.delete(f"{api}/v1/requests/{rid}")
    assert reply.status_code == 409 and "already ended" in reply.text
    Detail.model_validate(reply.json())


def test_readyz_lists_the_live_worker(stack, client):
    reply = client.get(f"{stack.urls[0]}/readyz").json()
    assert reply["status"] == "ready" and reply["workers"][0]["capacity"] == 8
    Ready.model_validate(reply)
    Healthy.model_validate(client.get(f"{stack.urls[0]}/healthz").json())
    cluster = client.get(f"{stack.urls[0]}/v1/cluster").json()  # the playground's view: the same heartbeats
    Cluster.model_validate(cluster)
    assert [w["worker"] for w in cluster["workers"]] == [w["worker"] for w in reply["workers"]]


def test_a_loopback_api_refuses_a_rebinding_pages_host_on_every_route(stack, client):
    """A page on evil.example whose name resolves to 127.0.0.1 has the browser send its own Host:
    no route answers it, adapter loading included; the loopback names are answered on any port."""
    api = stack.urls[0]
    evil = {"Host": "evil.example"}
    calls = [client.get(f"{api}/readyz", headers=evil), client.get(f"{api}/v1/cluster", headers=evil),
             client.get(f"{api}/v1/models", headers=evil),
             client.post(f"{api}/v1/load_lora_adapter", headers=evil, json={"lora_name": "x", "lora_path": "/tmp"}),
             client.post(f"{api}/v1/requests", headers=evil, json={"prompt": "x", "max_tokens": 2})]
    assert [c.status_code for c in calls] == [400] * 5
    assert "evil.example" in calls[3].json()["error"]["message"] and "evil.example" in calls[4].json()["detail"]
    port = api.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "localhost:1", "127.0.0.1", f"[::1]:{port}"):
        assert "workers" in client.get(f"{api}/readyz", headers={"Host": host}).json(), host


def test_logprobs_and_penalties_through_the_stack(stack, client):
    events = stream_events(client, "POST", f"{stack.urls[0]}/v1/requests", json={
        "prompt": "Once upon", "max_tokens": 6, "temperature": 0.8, "seed": 1, "logprobs": 3,
        "repetition_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {"7": -100},
        "logits_processors": [{"name": "ban_tokens", "token_ids": [8, 9]}], "stream": True})
    tokens = [e["data"] for e in events if e["event"] == "token"]
    assert tokens and all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in tokens)
    assert not {7, 8, 9} & {t["token_id"] for t in tokens}


def test_input_limits(stack, client):
    api = stack.urls[0]
    huge = client.post(f"{api}/v1/requests", content=b'{"prompt": "' + b"x" * 1_100_000 + b'"}',
                       headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "limit is 1000000" in huge.text
    capped = client.post(f"{api}/v1/requests", json={"prompt": "x", "max_tokens": 5000})
    assert capped.status_code in (400, 422)
    many_stops = client.post(f"{api}/v1/requests", json={"prompt": "x", "stop": ["a"] * 17})
    assert many_stops.status_code == 422 and "stop" in many_stops.text
    long_stop = client.post(f"{api}/v1/requests", json={"prompt": "x", "stop": ["a" * 300]})
    assert long_stop.status_code == 422
    bias = client.post(f"{api}/v1/requests", json={"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}})
    assert bias.status_code == 422 and "logit_bias" in bias.text
    n = client.post(f"{api}/v1/completions", json={"prompt": "x", "n": 17})
    assert n.status_code == 400 and n.json()["error"]["param"] == "n"


def _counter(text: str, endpoint: str, method: str, status: int) -> float:
    import re

    pattern = (r'^streamq:api_requests_total\{endpoint="' + re.escape(endpoint) + r'",method="' + method +
               r'",status="' + str(status) + r'"\} ([0-9.e+]+)$')
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_what_was_sent(stack, client):
    api = stack.urls[1]
    before = client.get(f"{api}/metrics").text
    for _ in range(3):
        submit(client, api, prompt="count me", max_tokens=1)
    client.post(f"{api}/v1/requests", json={"prompt": "x", "temperature": -1})
    client.get(f"{api}/v1/requests/5b0c2a8e-1111-4222-8333-444455556666")
    after = client.get(f"{api}/metrics").text
    assert _counter(after, "/v1/requests", "POST", 202) - _counter(before, "/v1/requests", "POST", 202) == 3
    assert _counter(after, "/v1/requests", "POST", 422) - _counter(before, "/v1/requests", "POST", 422) == 1
    assert _counter(after, "/v1/requests/{request_id}", "GET", 404) - \
        _counter(before, "/v1/requests/{request_id}", "GET", 404) == 1
    assert "streamq:api_open_streams " in after


def test_the_worker_runs_on_intel_openmp_where_it_is_installed(stack):
    from worker.model.openmp import intel_openmp

    proc = dict(stack.processes)["worker0"]
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    if intel_openmp() is None:  # not an x86-64 machine: torch's own runtime
        assert "libiomp5" not in maps
    else:
        assert str(intel_openmp()) in maps, "the worker did not restart with Intel's OpenMP preloaded"


def test_the_worker_asks_malloc_for_huge_pages(stack):
    from worker.model.openmp import HUGE_PAGES

    proc = dict(stack.processes)["worker0"]
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    want = stack.env.get("GLIBC_TUNABLES", HUGE_PAGES)  # one given is kept
    assert f"GLIBC_TUNABLES={want}".encode() in environ, "the worker did not restart with huge pages"


def test_the_worker_steps_with_the_compiled_cpu_kernels(stack):
    proc = dict(stack.processes)["worker0"]
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "streamq_step_" in maps, "the worker did not load the CPU step kernels (worker/model/kernels.py)"
