"""The bytes of every SSE stream the api sends, its headers, and what a client leaving does.

Each route is called with a fake generation (no Redis) and its response is run as ASGI; the
expected bodies are written out literally: clients parse these bytes (ids for Last-Event-ID,
the keepalive comment, the OpenAI [DONE] sentinel).
"""
from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

from api.core.stream_slots import StreamSlot, StreamSlots
from api.openai.schemas import ChatCompletionRequest, CompletionRequest
from api.openai import chat as chat_routes
from api.openai import completions as completion_routes
from api.native import requests as request_routes
from api.native import seed as seed_routes
from api.native.schemas import SubmitRequest
from shared.messages import (
    FinalEvent,
    FinishReason,
    RequestPayload,
    RequestStatus,
    StatusEvent,
    TokenEvent,
    Usage,
)
from shared.request_record import RequestRecord

RID = "9a7c2a8e-1111-4222-8333-444455556666"
FINAL = FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
                   usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1))


class _Tokenizer:
    vocab_size, context_length = 1000, 512

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class _Generation:
    """What the routes use of api.core.generation.Generation, replaying `events` then waiting forever."""

    model_name = "m"
    tokenizer = _Tokenizer()
    tool_format = None

    def __init__(self, events, end=True):
        self.events, self.end = events, end
        self.cancelled: list[str] = []
        self.closed = False

    async def encode(self, prompt=None, messages=None, tools=None):
        return [1, 2, 3]

    def build(self, prompt_ids, params, priority=0):
        return RequestPayload(id=RID, model="m", prompt_token_ids=prompt_ids, params=params)

    async def payloads(self, prompt, tenant="", compile=True):
        return [self.build([1, 2, 3], params) for params in prompt.samples]

    async def submit(self, payloads, tenant=""):
        pass

    async def cancel(self, payloads):
        self.cancelled += [p.id for p in payloads]

    async def follow(self, ids):
        try:
            for event in self.events:
                yield 0, event
            if not self.end:
                await asyncio.Event().wait()
        finally:
            self.closed = True

    async def get(self, name):  # the Models dependency: one model
        return self


class _Relay:
    def __init__(self, generation):
        self.generation = generation

    async def events(self, request_id, after=-1):
        async for _, event in self.generation.follow([request_id]):
            yield event


class _Store:
    async def record(self, request_id):
        return RequestRecord(status=RequestStatus.RUNNING)


class _Slots(StreamSlots):
    """Stream slots counted here, not in Redis: how many are open, how many were ever taken."""

    def __init__(self):
        super().__init__(None, "t", 0, 30)
        self.open = self.taken = 0

    async def take(self, tenant):
        self.open, self.taken = self.open + 1, self.taken + 1
        return StreamSlot(tenant, f"s{self.taken}", self)

    async def _release(self, slot):
        self.open -= 1


SLOTS = _Slots()


class _Gauge:
    def __init__(self):
        self.value = 0

    def inc(self):
        self.value += 1

    def dec(self):
        self.value -= 1


async def _run(response, leave_after: int | None = None):
    """Run `response` as ASGI: (status, headers, body). The client leaves after `leave_after` body chunks."""
    sent, chunk_sent = [], asyncio.Event()
    gauge = _Gauge()
    scope = {"type": "http", "method": "GET", "app": SimpleNamespace(state=SimpleNamespace(
        metrics=SimpleNamespace(open_streams=gauge)))}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            assert gauge.value == 1  # counted while open
            assert SLOTS.open == 1  # in its tenant's slot
            chunk_sent.set()

    async def receive():
        while leave_after is None or sum(1 for m in sent if m.get("body")) < leave_after:
            chunk_sent.clear()
            await chunk_sent.wait()
        return {"type": "http.disconnect"}

    taken = SLOTS.taken
    await asyncio.wait_for(response(scope, receive, send), 5)
    assert gauge.value == 0
    assert SLOTS.open == 0 and SLOTS.taken == taken  # its slot freed, whether it ended or its client left
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:]).decode()


def _check_headers(headers):
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"  # nginx passes each event through at once
    assert "content-length" not in headers


async def test_native_stream_bytes_ids_and_keepalive():
    tokens = [TokenEvent(index=4, token_id=7, text="a \"b\"\n"),
              TokenEvent(index=5, token_id=8, text="é😀", logprob=-0.5, top_logprobs=[(8, -0.5), (9, -1.25)])]
    generation = _Generation([StatusEvent(status=RequestStatus.RUNNING, worker="w1"), None, *tokens, FINAL])
    response = await request_routes.events(RID, _Store(), _Relay(generation), "", SLOTS, last_event_id=3)
    status, headers, body = await _run(response)
    assert status == 200
    _check_headers(headers)
    assert body == (
        'event: status\ndata: {"status": "running", "worker": "w1"}\n\n'
        ": keepalive\n\n"
        'id: 4\nevent: token\ndata: {"index": 4, "token_id": 7, "text": "a \\"b\\"\\n"}\n\n'
        'id: 5\nevent: token\ndata: {"index": 5, "token_id": 8, "text": "é😀", "logprob": -0.5, '
        '"top_logprobs": [[8, -0.5], [9, -1.25]]}\n\n'
        'event: final\ndata: {"status": "done", "finish_reason": "length", '
        '"usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}, "error": null, "code": null}\n\n')


async def test_submitted_stream_names_its_request_and_leaving_cancels_it():
    generation = _Generation([TokenEvent(index=0, token_id=7, text="a")], end=False)
    body = SubmitRequest(prompt="x", max_tokens=5, stream=True)
    response = await request_routes.submit(body, generation, _Relay(generation), "", SLOTS)
    status, headers, text = await _run(response, leave_after=1)
    assert headers["x-request-id"] == RID
    _check_headers(headers)
    assert text == 'id: 0\nevent: token\ndata: {"index": 0, "token_id": 7, "text": "a"}\n\n'
    assert generation.cancelled == [RID] and generation.closed


async def test_a_stream_that_ends_cancels_nothing():
    generation = _Generation([TokenEvent(index=0, token_id=7, text="a"), FINAL])
    response = await request_routes.submit(SubmitRequest(prompt="x", stream=True), generation,
                                           _Relay(generation), "", SLOTS)
    await _run(response)
    assert generation.cancelled == [] and generation.closed


def _chunks(body: str) -> list:
    """The OpenAI stream's frames: every one `data: <JSON>` or the final `data: [DONE]`."""
    frames = body.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    out = []
    for frame in frames[:-2]:
        if frame == ": keepalive":
            out.append(None)
            continue
        assert frame.startswith("data: ") and "\n" not in frame
        out.append(json.loads(frame.removeprefix("data: ")))
    return out


async def test_completion_stream_frames_and_done():
    generation = _Generation([None, TokenEvent(index=0, token_id=7, text="é"), TokenEvent(index=1, token_id=8, text=""),
                              FINAL])
    body = CompletionRequest(prompt="x", max_tokens=2, stream=True, stream_options={"include_usage": True})
    response = await completion_routes.completions(body, generation, "", SLOTS, None)
    status, headers, text = await _run(response)
    _check_headers(headers)
    assert '"text": "é"' in text  # not \u-escaped
    chunks = _chunks(text)
    assert chunks[0] is None
    assert [c["choices"] for c in chunks[1:]] == [
        [{"index": 0, "text": "é", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        []]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 1}}
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", chunks[1]["id"]) and chunks[1]["object"] == "text_completion"


async def test_chat_stream_frames_and_done():
    generation = _Generation([TokenEvent(index=0, token_id=7, text="hi"), None, FINAL])
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    response = await chat_routes.chat_completions(body, generation, "", SLOTS)
    status, headers, text = await _run(response)
    _check_headers(headers)
    chunks = _chunks(text)
    assert [c and c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""},
                                                                {"content": "hi"}, None, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_stream_that_the_client_leaves_is_cancelled():
    generation = _Generation([TokenEvent(index=0, token_id=7, text="a")], end=False)
    response = await completion_routes.completions(CompletionRequest(prompt="x", stream=True), generation, "", SLOTS, None)
    await _run(response, leave_after=1)
    assert generation.cancelled == [RID] and generation.closed


async def test_seed_tutorial_stream_bytes():
    generation = _Generation([None, TokenEvent(index=0, token_id=7, text="Hi \""),
                              TokenEvent(index=1, token_id=8, text=""), FINAL])
    response = await seed_routes.generate_stream(seed_routes.GenerateRequest(prompt="x"), generation, "", SLOTS)
    status, headers, text = await _run(response)
    _check_headers(headers)
    assert text == f': keepalive\n\ndata: {{"token": "Hi \\"", "sequence_id": "{RID}"}}\n\n'


def test_each_protocol_writes_its_events_in_its_dialect():
    from api.core.sse import ANTHROPIC, NATIVE, OPENAI, RESPONSES

    event = {"type": "message_stop", "n": "é"}
    assert OPENAI.event(event) == 'data: {"type": "message_stop", "n": "é"}\n\n'
    assert OPENAI.last == "data: [DONE]\n\n" and OPENAI.keepalive == ": keepalive\n\n"
    assert ANTHROPIC.event(event) == 'event: message_stop\ndata: {"type": "message_stop", "n": "é"}\n\n'
    assert ANTHROPIC.keepalive == 'event: ping\ndata: {"type": "ping"}\n\n' and ANTHROPIC.last is None
    assert RESPONSES.event(event).startswith("event: message_stop\n") and RESPONSES.keepalive == ": keepalive\n\n"
    assert NATIVE.event({"index": 4}, "token", 4) == 'id: 4\nevent: token\ndata: {"index": 4}\n\n'
