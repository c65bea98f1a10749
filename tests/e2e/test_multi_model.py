"""Several models behind one api: each model has its own request stream and workers; the api
loads the tokenizer of any model with a live worker from what that worker published."""
from __future__ import annotations

import time

import httpx
import pytest

from shared.messages import RequestStatus
from shared.tokenizer import Tokenizer
from tests.e2e.helpers import hf_greedy, submit, wait_done
from tests.stack import Stack, hold_mid_stream


@pytest.fixture(scope="module")
def two_models(redis_url, tiny_llama, tiny_opt, tmp_path_factory):
    # The api is configured with the llama model only; the second worker serves OPT.
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("multi"), workers=2,
               worker_envs=[{}, {"STREAMQ_MODEL": str(tiny_opt)}]) as stack:
        _wait_listed(stack, {tiny_llama.name, tiny_opt.name})
        yield stack


def _wait_listed(stack: Stack, models: set[str]) -> None:
    deadline = time.monotonic() + 120
    while models - _listed(stack):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)  # start-up polling only


def _listed(stack: Stack) -> set[str]:
    return {m["id"] for m in httpx.get(f"{stack.urls[0]}/v1/models", timeout=10).json()["data"]}


def test_models_lists_every_model_with_a_live_worker(two_models, tiny_llama, tiny_opt):
    assert _listed(two_models) == {tiny_llama.name, tiny_opt.name}


def test_a_request_for_the_other_model_runs_on_its_worker(two_models, tiny_opt):
    api = two_models.urls[0]
    with httpx.Client(timeout=120) as client:
        reply = client.post(f"{api}/v1/completions", json={
            "model": tiny_opt.name, "prompt": "a b c", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == tiny_opt.name
        ids = Tokenizer(tiny_opt).encode("a b c")
        assert body["usage"]["prompt_tokens"] == len(ids)  # counted with OPT's tokenizer, not llama's
        rid = submit(client, api, model=tiny_opt.name, prompt="a b c", max_tokens=8, temperature=0,
                     ignore_eos=True)["id"]
        state = wait_done(client, api, rid)
        assert state["worker"] == two_models.worker_name(1) and state["model"] == tiny_opt.name
        events = client.get(f"{api}/v1/requests/{rid}").json()
        assert events["completion_tokens"] == 8
        assert [t for t in _token_ids(client, api, rid)] == hf_greedy(tiny_opt, ids, 8, ignore_eos=True)


def test_a_model_nobody_serves_gets_404_with_the_served_ones(two_models, tiny_llama, tiny_opt):
    reply = httpx.post(f"{two_models.urls[0]}/v1/chat/completions", timeout=30, json={
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and tiny_llama.name in error["message"] and tiny_opt.name in error["message"]


def _token_ids(client: httpx.Client, api: str, rid: str) -> list[int]:
    from tests.e2e.helpers import events_of, token_ids

    return token_ids(events_of(client, api, rid))


def test_the_scheduler_takes_back_a_request_of_a_model_it_was_not_started_with(redis_url, tiny_llama, tiny_opt,
                                                                                 tmp_path):
    """The scheduler and the api name the llama model; the only OPT worker dies mid-request. No worker
    of OPT is left to reclaim it (the llama worker looks at its own model's queue only): the
    scheduler puts it back, and the next OPT worker finishes it, the stream undisturbed."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1",
           "STREAMQ_TRIM_INTERVAL_S": "1"}
    body = {"model": tiny_opt.name, "prompt": "a b c", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=True, env=env,
               worker_envs=[{}, {"STREAMQ_MODEL": str(tiny_opt)}]) as stack:
        _wait_listed(stack, {tiny_llama.name, tiny_opt.name})
        held = hold_mid_stream(stack, f"{stack.url}/v1/requests", body)
        victim = held.record.worker
        assert victim == stack.worker_name(1)
        stack.kill_paused_worker(victim)
        stack.wait_for_record(lambda r: r.model == tiny_opt.name and r.attempts == 1
                              and r.status == RequestStatus.QUEUED)  # by the scheduler: no OPT worker lives
        successor = stack.replace_worker(victim)
        events = held.events()
        record = stack.record(held.request_id)
    tokens = [e for e in events if e["event"] == "token"]
    assert record.status == RequestStatus.DONE and record.worker == successor and record.attempts == 1
    assert [int(e["id"]) for e in tokens] == list(range(60))
    assert [e["data"]["token_id"] for e in tokens] == hf_greedy(tiny_opt, Tokenizer(tiny_opt).encode("a b c"), 60,
                                                                ignore_eos=True)
