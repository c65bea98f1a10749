"""Stored responses of the Responses API, and their events made from the request's token log.

A response is one queued request (api/generation.py) and a record beside it: the request's
settings as the response object repeats them, its input items, the conversation it continues
(for a later `previous_response_id`), its tool format. Its status, output, usage and streaming
events are not stored: they are made from the request's record and token log, which every
replica reads (shared/store.py). `ResponseEvents` is a pure function of the token sequence, so
the events of a response are numbered the same on every replica, after any failover, and a
client resumes a stream `starting_after` any sequence number anywhere.

Keys: the record lies under its tenant (shared/redis_keys.response_record), so another tenant's
id is simply not found. It expires `retention_s` after its creation; the request's record and
token log are kept at least as long (`keep`).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from api import hermes
from api import tools as tool_format
from api.responses_schemas import InputItem, dump_items, load_items
from api.tool_stream import CallDelta, ToolCallStream
from shared import redis_keys
from shared.messages import FinalEvent, FinishReason, KeptResponse, RequestStatus, TokenEvent, decode_event
from shared.request_record import RequestRecord
from shared.store import RequestStore

# The response object's status while the request waits for a worker, and while it runs.
LIVE_STATUS = {RequestStatus.QUEUED: "queued", RequestStatus.RUNNING: "in_progress"}
# Its final status by the request's finish reason.
FINAL_STATUS = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete",
                FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "failed", FinishReason.EXPIRED: "failed"}
# The event that ends a stream, by final status (a cancelled stream ends after closing its items).
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class ResponseRecord:
    """What is stored of a response: fixed when it is created."""
    id: str
    tenant: str
    request_id: str
    model: str
    created_at: int
    echo: dict[str, Any]  # the request's settings, as the response object repeats them
    input_items: list[InputItem]  # this response's input, with ids
    context: list[InputItem]  # the conversation it ran on: earlier turns, then its input
    tools: str  # the reply's tool format: "none", "generic" or "hermes"
    prompt_tokens: int

    def fields(self) -> dict[str, str]:
        return {"request_id": self.request_id, "model": self.model, "created_at": str(self.created_at),
                "echo": json.dumps(self.echo, ensure_ascii=False), "input_items": dump_items(self.input_items),
                "context": dump_items(self.context), "tools": self.tools, "prompt_tokens": str(self.prompt_tokens)}

    @classmethod
    def of(cls, response_id: str, tenant: str, fields: dict[str, str]) -> ResponseRecord:
        return cls(id=response_id, tenant=tenant, request_id=fields["request_id"], model=fields["model"],
                   created_at=int(fields["created_at"]), echo=json.loads(fields["echo"]),
                   input_items=load_items(fields["input_items"]), context=load_items(fields["context"]),
                   tools=fields["tools"], prompt_tokens=int(fields["prompt_tokens"]))


def with_ids(response_id: str, items: list[InputItem]) -> list[InputItem]:
    """The input items, each with an id (its own, or one made from the response's) and a status."""
    stem = response_id.removeprefix("resp_")
    kinds = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    return [item.model_copy(update={"id": item.id or f"{kinds[item.type]}_{stem}_in{i}",
                                    "status": item.status or "completed"})
            for i, item in enumerate(items)]


class ResponseStore:
    """Response records of one key prefix, under their tenant."""

    def __init__(self, store: RequestStore, retention_s: int):
        self.store = store
        self.redis: Redis = store.redis
        self.prefix = store.prefix
        self.retention_s = retention_s

    def _key(self, tenant: str, response_id: str) -> str:
        return redis_keys.response_record(self.prefix, tenant, response_id)

    async def create(self, record: ResponseRecord) -> None:
        """The record, expiring after the retention; kept longer than a request's result, it is
        also put where the scheduler finds it to keep the request as long (keep_responses)."""
        key = self._key(record.tenant, record.id)
        async with self.redis.pipeline(transaction=False) as pipe:  # two slots on a Redis Cluster
            pipe.hset(key, mapping=record.fields())
            pipe.expire(key, self.retention_s)
            if self.retention_s > redis_keys.RESULT_TTL_S:
                member = KeptResponse(tenant=record.tenant, response_id=record.id, request_id=record.request_id).encode()
                pipe.zadd(redis_keys.kept_responses(self.prefix), {member: record.created_at})
            await pipe.execute()

    async def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        if not response_id.startswith("resp_"):
            return None
        fields = await self.redis.hgetall(self._key(tenant, response_id))
        return ResponseRecord.of(response_id, tenant, fields) if fields else None

    async def delete(self, record: ResponseRecord) -> None:
        """The response and its request's record and token log."""
        async with self.redis.pipeline(transaction=False) as pipe:  # three slots on a Redis Cluster
            pipe.delete(self._key(record.tenant, record.id))
            pipe.delete(redis_keys.request_record(self.prefix, record.request_id))
            pipe.delete(redis_keys.token_log(self.prefix, record.request_id))
            await pipe.execute()

    async def keep(self, record: ResponseRecord) -> None:
        """The finished request's record and token log kept as long as the response (its end
        set them to expire RESULT_TTL_S later)."""
        await self.store.keep_result(record.request_id, await self.redis.ttl(self._key(record.tenant, record.id)))

    async def logged(self, record: ResponseRecord
                     ) -> tuple[RequestRecord | None, list[TokenEvent], FinalEvent | None]:
        """The request's record (None once it is gone), its tokens by index and its final event, as
        logged so far."""
        request = await self.store.record(record.request_id)
        tokens: dict[int, TokenEvent] = {}
        final = None
        for _, data in await self.store.events(record.request_id):
            event = decode_event(data)
            if isinstance(event, TokenEvent):
                tokens.setdefault(event.index, event)
            elif isinstance(event, FinalEvent):
                final = event
                break
        return request, [tokens[i] for i in sorted(tokens)], final

    async def snapshot(self, record: ResponseRecord) -> tuple[ResponseEvents, list[dict[str, Any]]]:
        """The response as it stands, and every event it has had so far."""
        request, tokens, final = await self.logged(record)
        events = ResponseEvents(record)
        out = events.start()
        for token in tokens:
            out += events.token(token)
        if final is not None:
            out += events.final(final, whole_seconds(request.finished_at if request else None))
        elif request is not None and request.status in LIVE_STATUS:
            events.status = LIVE_STATUS[request.status]
        return events, out


def whole_seconds(value: float | None) -> int | None:
    """A record's time field in whole seconds; None where unset."""
    return int(value) if value else None


class ResponseEvents:
    """The events of one response, numbered from 0, made from its request's events in order:
    `start` once, `token` for each token, `final` at the end; `response` is the response object
    as it stands. Text streams token by token; in a tool format, each function call streams as
    the model writes it (api/tool_stream.py: its item once the name is whole, then its arguments'
    pieces), and the rest of the reply is read whole at the end (an answer becomes a message).
    Every id is made from the response's, so a replay makes exactly the same events."""

    def __init__(self, record: ResponseRecord):
        self.record = record
        self.stem = record.id.removeprefix("resp_")
        self.sequence = 0
        self.status = "queued"
        self.output: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.holding = record.tools != "none"
        self.message: dict[str, Any] | None = None  # the message item being streamed
        self.calls = ToolCallStream()  # a tool reply's calls, as they are written
        self.call: dict[str, Any] | None = None  # the function call item being streamed
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: int | None = None

    @property
    def live(self) -> bool:
        """Queued or in progress: not ended yet."""
        return self.status in LIVE_STATUS.values()

    def response(self) -> dict[str, Any]:
        r = self.record
        return {"id": r.id, "object": "response", "created_at": r.created_at, "model": r.model, **r.echo,
                "status": self.status, "output": json.loads(json.dumps(self.output)), "usage": self.usage,
                "error": self.error, "incomplete_details": self.incomplete, "completed_at": self.completed_at}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        created = self._event("response.created", response=self.response())
        self.status = "in_progress"
        return [created, self._event("response.in_progress", response=self.response())]

    def token(self, token: TokenEvent) -> list[dict[str, Any]]:
        if not token.text:
            return []
        self.text.append(token.text)
        if self.holding:
            return [event for call in self.calls.feed(token.text) for event in self._call_delta(call)]
        out = self._open_message()
        return out + [self._event("response.output_text.delta", item_id=self.message["id"], output_index=0,
                                  content_index=0, delta=token.text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        self.message = {"id": f"msg_{self.stem}", "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        self.output.append(self.message)
        index = len(self.output) - 1
        added = self._event("response.output_item.added", output_index=index, item=json.loads(json.dumps(self.message)))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                   content_index=0, part=dict(part))]

    def final(self, final: FinalEvent, completed_at: int | None) -> list[dict[str, Any]]:
        status = FINAL_STATUS[final.finish_reason]
        text = "".join(self.text)
        out: list[dict[str, Any]] = []
        if self.holding:
            parse = hermes.parse if self.record.tools == "hermes" else tool_format.parse
            reply = tool_format.read_reply(text, final.finish_reason.value, parse)
            content, calls = reply.content, reply.tool_calls
            if self.call is not None:  # cut by max_output_tokens: as far as it got
                out += self._close_call("incomplete")
            if content and not self.calls.calls:
                self.holding, self.text = False, []
                out += self._open_message()
                self.text = [content]
                out.append(self._event("response.output_text.delta", item_id=self.message["id"], output_index=0,
                                       content_index=0, delta=content, logprobs=[]))
            for i, call in enumerate(calls[self.calls.calls:], start=self.calls.calls):  # none streamed: whole
                out += self._function_call(i, call["function"]["name"], call["function"]["arguments"])
        elif status in ("completed", "incomplete"):
            out += self._open_message()
        if self.message is not None:
            out += self._close_message("incomplete" if status != "completed" else "completed")
        self.status = status
        self.usage = _usage(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens)
        if status == "incomplete":
            self.incomplete = {"reason": "max_output_tokens"}
        if status == "failed":
            self.error = {"code": "server_error", "message": final.error or f"the request {final.status.value}"}
        self.completed_at = completed_at if status == "completed" else None
        if status in TERMINAL:
            out.append(self._event(TERMINAL[status], response=self.response()))
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, index = self.message, self.output.index(self.message)
        text = "".join(self.text)
        message["content"][0]["text"] = text
        message["status"] = status
        part = dict(message["content"][0])
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(message)))]

    def _call_delta(self, call: CallDelta) -> list[dict[str, Any]]:
        """A streamed call's events: its item at its name, its arguments' pieces, done at its close."""
        out: list[dict[str, Any]] = []
        if call.name is not None:
            self.call = {"id": f"fc_{self.stem}_{call.index}", "type": "function_call", "status": "in_progress",
                         "call_id": f"call_{self.stem[:24]}_{call.index}", "name": call.name, "arguments": ""}
            self.output.append(self.call)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(self.call)))
        if call.arguments:
            self.call["arguments"] += call.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                   output_index=self.output.index(self.call), delta=call.arguments))
        if call.closed:
            out += self._close_call("completed")
        return out

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        item, self.call = self.call, None
        item["status"] = status
        index = self.output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _function_call(self, i: int, name: str, arguments: str) -> list[dict[str, Any]]:
        """A call read whole at the end: the streamed call's events, in one go."""
        return self._call_delta(CallDelta(i, "", name=name)) + self._call_delta(CallDelta(i, arguments, closed=True))

    def output_items(self) -> list[InputItem]:
        """The response's output as input items of a later turn."""
        return load_items(json.dumps([{k: v for k, v in item.items() if k != "status"} | {"status": "completed"}
                                      for item in self.output]))


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def now_s() -> int:
    return int(time.time())
