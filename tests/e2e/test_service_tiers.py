"""Service tiers through real processes: a running flex request gives way to a priority one and
ends as it would have alone; the answers name the tier that served them."""
import httpx
import pytest

from shared import redis_keys
from shared.tokenizer import Tokenizer
from tests.stack import Stack, hold_mid_stream
from tests.waiting import until_sync

NEW = 200  # long enough that the worker, running ahead of its client, is paused with most of it to go
PROMPT = "the capital of France is Paris and once upon a time"


@pytest.fixture(scope="module")
def one_slot(redis_url, tiny_llama, tmp_path_factory):
    # One request at a time; a long heartbeat TTL: a worker paused by a test stays live meanwhile.
    env = {"STREAMQ_BATCH_SIZE": "1", "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "120"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("tiers"), env=env) as stack:
        yield stack


def _hold_flex(stack: Stack, url: str, body: dict, attempts: int = 3):
    """A flex stream held mid-request (hold_mid_stream) with at least a few steps still to run: a
    worker runs ahead of its client, and on a loaded machine may be paused near the end."""
    for _ in range(attempts):
        held = hold_mid_stream(stack, f"{url}/v1/requests", {**body, "stream": True, "service_tier": "flex"},
                               at_token=2)
        with stack.redis() as client:
            done = client.xlen(redis_keys.token_log(stack.prefix, held.request_id))
        if done < NEW - 8:
            return held
        stack.resume_workers()
        held.events()
    raise AssertionError(f"the flex request was paused near its end {attempts} times")


def test_a_running_flex_request_gives_way_to_a_priority_one_and_ends_as_it_would_alone(one_slot, tiny_llama):
    url = one_slot.urls[0]
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json={**body, "service_tier": "flex"}, timeout=120)
    assert alone.status_code == 200 and alone.json()["service_tier"] == "flex"
    held = _hold_flex(one_slot, url, body)
    try:  # the batch's one slot is the flex request's: the priority one is queued behind it
        queued = httpx.post(f"{url}/v1/requests", json={**body, "service_tier": "priority"}, timeout=60)
        assert queued.status_code == 202, queued.text
    finally:
        one_slot.resume_workers()
    tokens = [e["data"]["token_id"] for e in held.events() if e["event"] == "token"]
    assert Tokenizer(tiny_llama).decode(tokens) == alone.json()["choices"][0]["text"]  # nothing lost or repeated
    until_sync(lambda: one_slot.record(queued.json()["id"]).status == "done", 120, "the priority request done")
    flex, priority = one_slot.record(held.request_id), one_slot.record(queued.json()["id"])
    # With one slot, the priority request ends first only if the running flex one was preempted.
    assert priority.finished_at < flex.finished_at


def test_answers_name_their_tier_and_an_unknown_tier_is_a_400(one_slot):
    url = one_slot.urls[0]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=120) as client:
        # auth off: every tier is the operator's; auto is default
        assert client.post(f"{url}/v1/chat/completions", json=chat).json()["service_tier"] == "default"
        with client.stream("POST", f"{url}/v1/chat/completions",
                           json={**chat, "stream": True, "service_tier": "priority"}) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
        assert chunks and all('"service_tier": "priority"' in c or '"service_tier":"priority"' in c for c in chunks)
        response = client.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                            "service_tier": "flex"})
        assert response.status_code == 200 and response.json()["service_tier"] == "flex"
        message = client.post(f"{url}/v1/messages", json={**chat, "model": one_slot.model_name, "service_tier": "standard_only"})
        assert message.status_code == 200 and message.json()["usage"]["service_tier"] == "standard"
        bad = client.post(f"{url}/v1/chat/completions", json={**chat, "service_tier": "scale"})
        assert bad.status_code == 400 and "service_tier" in bad.text
        bad = client.post(f"{url}/v1/messages", json={**chat, "model": one_slot.model_name, "service_tier": "flex"})  # Anthropic's names only
        assert bad.status_code == 400 and "service_tier" in bad.text
