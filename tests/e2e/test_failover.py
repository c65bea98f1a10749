"""A worker killed with SIGKILL mid-stream: another takes its requests over and every client's
text is exactly the undisturbed greedy text, with no event lost or repeated."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared import redis_keys
from shared.messages import FinalEvent, RequestStatus, decode_event
from shared.redis_keys import EVENT_FIELD
from shared.tokenizer import Tokenizer
from streamq.stack import live_workers
from tests.e2e.helpers import events_of, hf_greedy
from tests.e2e.test_speculative import SPEC_ENV
from tests.stack import Stack, hold_mid_stream, kill_mid_stream, parse_sse, stream_posted
from tests.waiting import until_sync

PROMPTS = ["Once", "The capital of France is", "a b c", "Seoul and Paris", "🚀", "streams", "x y", "cache"]
TOKENS = 200


@pytest.mark.parametrize("speculation", [{}, SPEC_ENV], ids=["plain", "speculative"])
def test_worker_crash_is_invisible_to_clients(redis_url, tiny_llama, tmp_path, speculation):
    """With speculative decoding, steps emit several tokens at once: the takeover still resumes
    after exactly the last token delivered."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1",
           **speculation}
    tok = Tokenizer(tiny_llama)
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=True, env=env) as stack, \
            httpx.Client(timeout=120) as client:
        api = stack.urls[0]
        started = threading.Event()
        first_id: list[str] = []

        def watch(request_id: str) -> None:
            if not started.is_set():
                stack.pause_workers()  # at its first token: no worker can finish it before the kill
                first_id.append(request_id)
                started.set()

        def run(prompt: str) -> list[dict]:
            body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            return stream_posted(client, f"{api}/v1/requests", body, 1, watch)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(run, p) for p in PROMPTS]
            assert started.wait(60)
            running = client.get(f"{api}/v1/requests/{first_id[0]}").json()
            assert running["status"] == "running", running
            victim = running["worker"]
            stack.kill_paused_worker(victim)
            results = [f.result() for f in futures]

        for prompt, events in zip(PROMPTS, results):
            tokens = [e for e in events if e["event"] == "token"]
            assert [int(e["id"]) for e in tokens] == list(range(TOKENS)), prompt  # none lost, none twice
            assert [e["data"]["token_id"] for e in tokens] == hf_greedy(tiny_llama, tok.encode(prompt), TOKENS, ignore_eos=True)
            assert events[-1]["data"]["finish_reason"] == "length"
        # The request seen mid-stream was taken over: another worker finished it, on its 2nd attempt.
        state = client.get(f"{api}/v1/requests/{first_id[0]}").json()
        assert state["worker"] != victim and state["status"] == "done"
        record = stack.wait_for_record(lambda r: r.worker == state["worker"] and r.attempts == 1)
        assert record.status == RequestStatus.DONE


def test_api_replica_crash_clients_resume_on_the_other(redis_url, tiny_llama, tmp_path):
    """Kill the replica a client streams from; it reconnects to the other with Last-Event-ID and
    gets exactly the remaining events (the request itself never noticed)."""
    with Stack(redis_url, tiny_llama, tmp_path, replicas=2) as stack, httpx.Client(timeout=120) as client:
        first, second = stack.urls
        body = {"prompt": "Once", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        seen, lines, rid = [], [], None
        try:
            with client.stream("POST", f"{first}/v1/requests", json=body) as reply:
                rid = reply.headers["X-Request-Id"]
                for line in reply.iter_lines():
                    lines.append(line)
                    if line == "":
                        seen += [e for e in parse_sse(lines) if e["event"] == "token"]
                        lines = []
                        if len(seen) == 10:
                            stack.kill_replica(0)
        except httpx.HTTPError:
            pass  # the connection died with the replica
        assert 10 <= len(seen) < TOKENS
        last = int(seen[-1]["id"])
        rest = events_of(client, second, rid, last_event_id=last)
        tokens = seen + [e for e in rest if e["event"] == "token"]
        assert [int(e["id"]) for e in tokens] == list(range(TOKENS))
        assert rest[-1]["event"] == "final" and rest[-1]["data"]["status"] == "done"
        tok = Tokenizer(tiny_llama)
        assert [e["data"]["token_id"] for e in tokens] == hf_greedy(tiny_llama, tok.encode("Once"), TOKENS,
                                                                    ignore_eos=True)


def test_a_poison_request_is_dead_lettered_and_the_rest_are_served(redis_url, tiny_llama, tmp_path):
    """A request whose workers keep dying: after max_attempts it fails with the reason, and the
    workers that are left keep serving everything else."""
    env = {**{"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1"},
           "STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "5", "STREAMQ_MAX_ATTEMPTS": "2"}
    with Stack(redis_url, tiny_llama, tmp_path, workers=3, scheduler=True, env=env) as stack, \
            httpx.Client(timeout=60) as client:
        api = stack.urls[0]
        poison = client.post(f"{api}/v1/requests", json={"prompt": "poison", "max_tokens": 200}).json()["id"]
        killed: set[str] = set()
        for _attempt in range(2):  # kill whichever live worker runs it now
            record = stack.wait_for_record(lambda r: r.status == RequestStatus.RUNNING and r.worker not in killed
                                           and '"max_tokens":200' in (r.params or ""))
            killed.add(record.worker)
            stack.kill_worker(record.worker)
        final = events_of(client, api, poison)[-1]["data"]
        assert final["status"] == "failed" and "2 times" in final["error"]
        state = client.get(f"{api}/v1/requests/{poison}").json()
        assert state["status"] == "failed" and "dead-letter" in state["error"]
        other = client.post(f"{api}/v1/requests", json={"prompt": "fine", "max_tokens": 3}).json()["id"]
        assert events_of(client, api, other)[-1]["data"]["status"] == "done"


def test_a_worker_with_room_takes_over_without_the_scheduler(redis_url, tiny_llama, tmp_path):
    """No scheduler runs: the other worker, idle, finds the dead one's request at its heartbeat
    and puts it back (shared/reclaim.py), and the stream ends with the undisturbed tokens."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1"}
    body = {"prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=False, env=env) as stack:
        events, _, rid, victim = kill_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body)
        record = stack.record(rid)
    tokens = [e for e in events if e["event"] == "token"]
    assert [int(e["id"]) for e in tokens] == list(range(120))
    assert record.worker != victim and record.status == RequestStatus.DONE and record.attempts == 1
    assert [e["data"]["token_id"] for e in tokens] == hf_greedy(tiny_llama, Tokenizer(tiny_llama).encode("Once"), 120,
                                                                ignore_eos=True)


def test_a_worker_whose_heartbeat_lapsed_takes_its_own_request_back_and_finishes_it(redis_url, tiny_llama, tmp_path):
    """The only worker pauses mid-request past its heartbeat's TTL: the scheduler puts the request
    back in the queue, and the worker, going on, takes it again while it still runs it. It must go
    on with it (not run it twice, which failed the whole batch), and the stream ends undisturbed."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    body = {"prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    with Stack(redis_url, tiny_llama, tmp_path, scheduler=True, env=env) as stack:
        held = hold_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body)
        stack.wait_for_record(lambda r: r.attempts == 1)  # put back by the scheduler
        stack.resume_worker()
        events = held.events()
        record = stack.wait_for_record(lambda r: r.status in (RequestStatus.DONE, RequestStatus.FAILED))
        logs = stack.logs()
    tokens = [e for e in events if e["event"] == "token"]
    assert record.status == RequestStatus.DONE, logs
    assert [int(e["id"]) for e in tokens] == list(range(120))
    assert [e["data"]["token_id"] for e in tokens] == hf_greedy(tiny_llama, Tokenizer(tiny_llama).encode("Once"), 120,
                                                                ignore_eos=True)


def test_a_paused_worker_resumed_after_a_takeover_adds_nothing_to_the_stream(redis_url, tiny_llama, tmp_path):
    """SIGSTOP the worker running a request past its heartbeat's TTL; the other worker takes it over;
    then the paused one goes on (SIGCONT), the request still in its batch, a step's tokens ready. Its
    late tokens and its final event are refused and it stops the request: the client sees each
    index once and one continuation, which is the token log's (no index twice there either) and the
    record's. Sampled without a seed, so the two workers' continuations differ."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    body = {"prompt": "Once", "max_tokens": 120, "temperature": 1.0, "ignore_eos": True, "stream": True}
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=True, env=env) as stack:
        held = hold_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body)
        rid, victim = held.request_id, held.record.worker
        other = next(name for name in stack.slots if name != victim)
        stack.resume_worker(other)
        until_sync(lambda: stack.record(rid).worker == other, 60, "the request taken over by the other worker")
        stack.resume_worker(victim)
        events = held.events()

        def victim_holds_nothing() -> bool:  # its heartbeat, written after it resumed, says so
            beat = next((w for w in live_workers(stack.url) or [] if w["worker"] == victim), None)
            return beat is not None and beat["running"] == beat["waiting"] == 0
        until_sync(victim_holds_nothing, 60, "the resumed worker done with the request")
        record = stack.record(rid)
        with stack.redis() as client:
            logged = [decode_event(f[EVENT_FIELD]) for _, f in client.xrange(redis_keys.token_log(stack.prefix, rid))]
        logs = stack.logs()
    tokens = [e for e in events if e["event"] == "token"]
    assert [int(e["id"]) for e in tokens] == list(range(120))  # none twice, none lost
    assert [e.index for e in logged[:-1]] == list(range(120)) and isinstance(logged[-1], FinalEvent), logs
    assert [e["data"]["token_id"] for e in tokens] == [e.token_id for e in logged[:-1]]
    assert (record.status, record.worker, record.completion_tokens) == (RequestStatus.DONE, other, 120)
    assert record.text == "".join(e["data"]["text"] for e in tokens)
    assert f"request {rid} was taken over by another worker" in logs


def test_a_replaced_worker_can_itself_be_paused_killed_and_replaced(redis_url, tiny_llama, tmp_path):
    """The launcher knows every worker by its consumer name, a replacement's too: benchmarks/kv_tier.py
    kills the worker named in a request's record, replaces it, and later kills the replacement."""
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1"}

    def live() -> set[str]:
        return {w["worker"] for w in live_workers(stack.url) or []}

    with Stack(redis_url, tiny_llama, tmp_path, workers=2, env=env) as stack:
        stack.wait_workers(2)
        first, other = stack.slots
        second = stack.replace_worker(first)
        assert stack.worker_name(0) == second != first and not stack.workers[first].running
        until_sync(lambda: live() == {second, other}, 60, "the replacement live, the killed one's heartbeat gone")
        stack.pause_workers()  # the two in the slots (the killed one's process group is gone)
        stack.resume_worker(second)
        stack.resume_worker(1)
        third = stack.replace_worker(second)
        assert third not in (first, second) and not stack.workers[second].running
        until_sync(lambda: live() == {third, other}, 60, "the second replacement live")
        stack.wait_workers(2)
