"""A worker killed mid-reply to a chat with images (two workers of a LLaVA, or of a Qwen2-VL whose
M-RoPE positions the continuation must rebuild, the scheduler, real Redis and processes): the other
worker takes the request over with its images (kept in Redis by sha256) and continues it; the
client's streamed reply is the undisturbed one, nothing lost or repeated."""
from __future__ import annotations

import json

import httpx
import pytest

from shared import redis_keys
from shared.messages import RequestStatus
from shared.request_record import RequestRecord
from streamq.testing.tiny_vision import build_llava, build_qwen2_vl, data_url, png
from tests.stack import Stack

pytestmark = pytest.mark.timeout(300)

FAST_FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
                 "STREAMQ_RECLAIM_INTERVAL_S": "1", "STREAMQ_SERVED_MODEL_NAME": "llava"}
TOKENS = 60


def _body(stream: bool) -> dict:
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(png(11))}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(png(12, (30, 70)))}}]
    return {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def _running(stack: Stack) -> list[tuple[str, RequestRecord]]:
    """The running requests' ids and records."""
    pattern = redis_keys.request_record(stack.prefix, "*")
    head, tail = pattern.split("*")
    found = []
    with stack.redis() as client:
        for key in client.scan_iter(match=pattern, count=1000):
            if client.type(key) == "hash":  # the token logs beside them are streams
                record = RequestRecord.of(client.hgetall(key))
                if record is not None and record.status == RequestStatus.RUNNING:
                    found.append((key[len(head):len(key) - len(tail)], record))
    return found


def _killed_mid_reply(stack: Stack, url: str, attempts: int = 5) -> tuple[str, str, str]:
    """Stream the chat and, at its second piece of text, pause every worker and kill the one
    running it (another request is tried where it had ended by then); the text, the request's
    id and the killed worker's name."""
    for _ in range(attempts):
        pieces, victim, rid = [], None, None
        with httpx.Client(timeout=120) as client, client.stream("POST", url, json=_body(True)) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if not delta:
                    continue
                pieces.append(delta)
                if len(pieces) == 2 and victim is None:
                    stack.pause_workers()
                    running = _running(stack)
                    if not running:  # it ended before the pause: go on, and try again
                        stack.resume_workers()
                        victim = ""
                        continue
                    rid, victim = running[0][0], running[0][1].worker
                    stack.kill_paused_worker(victim)
        if victim:
            return "".join(pieces), rid, victim
    raise AssertionError(f"the request ended before its worker was held, {attempts} times")


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_worker_killed_mid_reply_with_images_is_continued_with_them(redis_url, tmp_path_factory, family):
    folder = tmp_path_factory.mktemp(family)
    llava = build_qwen2_vl(folder) if family == "qwen2_vl" else build_llava(folder)
    with Stack(redis_url, llava, tmp_path_factory.mktemp("images-failover"), workers=2, scheduler=True,
               env=FAST_FAILOVER) as stack:
        url = f"{stack.urls[0]}/v1/chat/completions"
        undisturbed = httpx.post(url, json=_body(False), timeout=120).json()
        assert undisturbed["usage"]["completion_tokens"] == TOKENS
        text, rid, victim = _killed_mid_reply(stack, url)
        record = stack.record(rid)
    assert text == undisturbed["choices"][0]["message"]["content"]
    assert record.status == RequestStatus.DONE and record.worker != victim and record.attempts == 1
