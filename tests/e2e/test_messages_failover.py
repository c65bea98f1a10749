"""A Messages stream (the official `anthropic` client) whose worker is killed mid-reply: the other
worker takes the request over and the same stream goes on, with no text lost or repeated, to the
undisturbed reply's text."""
from __future__ import annotations

import anthropic
import pytest

from shared.messages import RequestStatus
from shared.request_record import RequestRecord
from tests.stack import Stack
from streamq.testing.tiny_models import CHAT_TEMPLATE, build_model

ASK = [{"role": "user", "content": "Tell me a long story about the streams and the caches"}]
TOKENS = 96


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    model = build_model(tmp_path_factory.mktemp("tiny-llama-messages-failover"), "llama", context=2048,
                        chat_template=CHAT_TEMPLATE)
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1"}
    with Stack(redis_url, model, tmp_path_factory.mktemp("messages-failover"), workers=2, env=env) as running:
        yield running


def _running(stack: Stack) -> list[RequestRecord]:
    return [r for r in stack.records() if r.status == RequestStatus.RUNNING]


def _text(events) -> str:
    return "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")


def test_a_worker_killed_mid_message_stream_goes_on_to_the_undisturbed_text(stack):
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)
    ask = {"model": stack.model_name, "max_tokens": TOKENS, "messages": ASK, "extra_body": {"temperature": 0}}
    undisturbed = client.messages.create(**ask)
    for _ in range(5):
        with client.messages.stream(**ask) as stream:
            events = iter(stream)
            seen = []
            for event in events:
                seen.append(event)
                if event.type == "content_block_delta":
                    stack.pause_workers()
                    break
            running = _running(stack)  # the workers are paused: what runs stays so
            if len(running) == 1:
                stack.kill_paused_worker(running[0].worker)
                seen += list(events)
                message = stream.get_final_message()
                break
            stack.resume_workers()  # it ended before the pause: try again
            list(events)
    else:
        raise AssertionError("the reply ended before its workers were paused, 5 times")
    assert seen[-1].type == "message_stop"
    assert _text(seen) == undisturbed.content[0].text
    assert message.content[0].text == undisturbed.content[0].text
    assert message.stop_reason == undisturbed.stop_reason and message.usage.output_tokens == undisturbed.usage.output_tokens
    assert any(r.attempts == 1 and r.status == RequestStatus.DONE for r in stack.records())
