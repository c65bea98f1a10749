"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

They go through the same Redis path as the native api: each of the `n` (or `best_of`)
samples is one queued request (they share the prompt's KV blocks through the worker's
prefix cache), followed through the relay; a streaming client that disconnects cancels them.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator

from fastapi import APIRouter

from api import hermes
from api.auth import TenantDep
from api.deps import ModelsDep
from api.errors import ApiError
from api.generation import Generation
from api.json_body import StrictJSONRoute
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.sse import DONE, KEEPALIVE, EventStreamResponse, json_frame
from api.tool_stream import CallDelta, ToolCallStream
from api.tools import Reply
from shared.messages import FinalEvent, FinishReason, RequestPayload, TokenEvent
from shared.tokenizer import Tokenizer

router = APIRouter(tags=["openai"], route_class=StrictJSONRoute)
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/batches")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ("rate_limit_error" if status == 429 else "invalid_request_error") if status < 500 else (
        "overloaded_error" if status == 503 else "server_error")
    if status == 404 and code is None:
        code = "not_found"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@router.get("/v1/models")
async def models(served: ModelsDep, tenant: TenantDep):
    """The models that have a live worker, and their LoRA adapters (`parent`: the base model)."""
    data = []
    for name in sorted(await served.served()):
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "streamq"}
        if (loaded := served.loaded(name)) is not None:
            entry["max_model_len"] = loaded.tokenizer.context_length
        data.append(entry)
    for name, adapter in sorted((await served.adapters()).items()):
        entry = adapter.entry
        if entry is None or entry.allows(tenant):  # a tenant sees only the adapters it may use
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "streamq", "parent": adapter.base,
                         "root": entry.path if entry is not None else None})
    return {"object": "list", "data": data}


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    final: FinalEvent | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


def finish_reason(final: FinalEvent) -> str:
    if final.finish_reason == FinishReason.ERROR:
        raise ApiError(500, f"generation failed: {final.error}")
    if final.finish_reason == FinishReason.EXPIRED:
        raise ApiError(503, final.error or "the request expired in the queue", code="expired")
    return "abort" if final.finish_reason == FinishReason.CANCELLED else final.finish_reason.value


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent], offset: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = _token_text(tokenizer, t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({_token_text(tokenizer, i): lp for i, lp in t.top_logprobs or []})
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def _chat_logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]}
                        for t in tokens]}


async def collect(generation: Generation, payloads: list[RequestPayload]) -> list[Choice]:
    choices = [Choice() for _ in payloads]
    async for i, event in generation.follow([p.id for p in payloads]):
        if isinstance(event, TokenEvent):
            choices[i].text.append(event.text)
            choices[i].tokens.append(event)
        elif isinstance(event, FinalEvent):
            choices[i].final = event
    return choices


def _usage(prompt_tokens: int, completion_tokens: int, finals: list[FinalEvent | None]) -> dict:
    """OpenAI's usage; its cached_tokens are the prompt tokens a worker took from a cache (the
    prefix cache or the shared KV tier), the most of the request's samples."""
    cached = max((f.usage.cached_tokens for f in finals if f is not None), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


async def _build(generation: Generation, body, prompt_ids: list[int], samples: int, max_tokens: int | None,
                 logprobs: int | None) -> list[RequestPayload]:
    try:
        payloads = [generation.build(prompt_ids, body.sampling(max_tokens, logprobs, i), body.priority)
                    for i in range(samples)]
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    if body.backend is not None:
        await generation.check_backend(body.backend)
        for payload in payloads:
            payload.backend = body.backend
    return payloads


async def plan_completion(body: CompletionRequest, generation: Generation) -> list[RequestPayload]:
    """The requests one completion call runs (n, or best_of, samples); checked, not queued."""
    generation.check_model(body.model)
    if isinstance(body.prompt, str):
        prompt_ids = await generation.encode(body.prompt)
    elif body.prompt and isinstance(body.prompt[0], str):
        prompt_ids = await generation.encode(body.prompt[0])
    else:
        prompt_ids = list(body.prompt)
        if any(not 0 <= t < generation.tokenizer.vocab_size for t in prompt_ids):
            raise ApiError(400, "prompt token ids must be within the vocabulary", param="prompt")
    samples = body.best_of or body.n
    logprobs = body.logprobs if body.logprobs is not None else (0 if samples > body.n else None)
    return await _build(generation, body, prompt_ids, samples, body.max_tokens, logprobs)


async def plan_chat(body: ChatCompletionRequest, generation: Generation) -> tuple[list[RequestPayload], int | None]:
    """The requests one chat call runs, and the logprobs it asked for; checked, not queued."""
    generation.check_model(body.model)
    if body.calls_tools and hermes.knows(generation.tokenizer):
        try:
            body.in_hermes_format()
        except ValueError as exc:  # the tools' grammar in this format does not compile
            raise ApiError(400, str(exc), param="tools") from exc
    try:
        messages = body.template_messages()
        logprobs = body.wanted_logprobs()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    prompt_ids = await generation.encode(messages=messages, tools=body.template_tools())
    return await _build(generation, body, prompt_ids, body.n, body.max_completion_tokens or body.max_tokens,
                        logprobs), logprobs


@router.post("/v1/completions")
async def completions(body: CompletionRequest, served: ModelsDep, tenant: TenantDep):
    generation = await served.get(body.model)
    tokenizer = generation.tokenizer
    payloads = await plan_completion(body, generation)
    await generation.submit(payloads, tenant=tenant)
    prompt_ids, samples = payloads[0].prompt_token_ids, len(payloads)
    ranking = samples > body.n
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), generation.model_name
    if body.stream:
        events = _stream_completion(generation, tokenizer, body, payloads, rid, created, model)
        return EventStreamResponse(events, on_disconnect=lambda: generation.cancel(payloads))
    choices = await collect(generation, payloads)
    reasons = [finish_reason(c.final) for c in choices]
    order = list(range(samples))
    if ranking:
        order = sorted(order, key=lambda i: choices[i].cumulative_logprob, reverse=True)[:body.n]
    out = []
    for index, i in enumerate(order):
        c = choices[i]
        lp = _completion_logprobs(tokenizer, c.tokens, 0) if body.logprobs is not None else None
        out.append({"index": index, "text": "".join(c.text), "logprobs": lp, "finish_reason": reasons[i]})
    usage = _usage(len(prompt_ids), sum(len(c.tokens) for c in choices), [c.final for c in choices])
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out, "usage": usage}


async def _stream_completion(generation: Generation, tokenizer: Tokenizer, body: CompletionRequest,
                             payloads: list[RequestPayload], rid: str, created: int, model: str) -> AsyncIterator[str]:
    usage_on = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    offsets = [0] * len(payloads)
    completion_tokens, finals = 0, []
    async for i, event in generation.follow([p.id for p in payloads]):
        if event is None:
            yield KEEPALIVE
            continue
        choice: dict[str, Any] | None = None
        if isinstance(event, TokenEvent):
            completion_tokens += 1
            if not event.text and body.logprobs is None:
                continue
            lp = _completion_logprobs(tokenizer, [event], offsets[i]) if body.logprobs is not None else None
            offsets[i] += len(event.text)
            choice = {"index": i, "text": event.text, "logprobs": lp, "finish_reason": None}
        elif isinstance(event, FinalEvent):
            finals.append(event)
            choice = {"index": i, "text": "", "logprobs": None, "finish_reason": stream_reason(event)}
        if choice is not None:
            yield json_frame({**base, "choices": [choice], **({"usage": None} if usage_on else {})})
    if usage_on:
        prompt_tokens = len(payloads[0].prompt_token_ids)
        yield json_frame({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, finals)})
    yield DONE


def stream_reason(final: FinalEvent) -> str:
    try:
        return finish_reason(final)
    except ApiError:
        return "error"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, served: ModelsDep, tenant: TenantDep):
    generation = await served.get(body.model)
    tokenizer = generation.tokenizer
    payloads, logprobs = await plan_chat(body, generation)
    await generation.submit(payloads, tenant=tenant)
    prompt_ids = payloads[0].prompt_token_ids
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), generation.model_name
    if body.stream:
        events = _stream_chat(generation, tokenizer, body, payloads, rid, created, model, logprobs)
        return EventStreamResponse(events, on_disconnect=lambda: generation.cancel(payloads))
    choices = await collect(generation, payloads)
    out = []
    for i, c in enumerate(choices):
        reply = body.reply("".join(c.text), finish_reason(c.final))
        out.append({"index": i, "message": _message(reply),
                    "logprobs": _chat_logprobs(tokenizer, c.tokens) if logprobs is not None else None,
                    "finish_reason": reply.finish_reason})
    usage = _usage(len(prompt_ids), sum(len(c.tokens) for c in choices), [c.final for c in choices])
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage}


def _message(reply: Reply) -> dict:
    """The assistant message of a reply: its calls, or its answer."""
    if reply.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": reply.tool_calls}
    return {"role": "assistant", "content": reply.content}


async def _stream_chat(generation: Generation, tokenizer: Tokenizer, body: ChatCompletionRequest,
                       payloads: list[RequestPayload], rid: str, created: int, model: str,
                       logprobs: int | None) -> AsyncIterator[str]:
    usage_on = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if usage_on else {}

    def frame(i: int, delta: dict, lp: Any = None, reason: str | None = None) -> str:
        return json_frame({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                           **extra})

    for i in range(len(payloads)):
        yield frame(i, {"role": "assistant", "content": ""})
    completion_tokens, held, finals = 0, HeldReplies(body, len(payloads)), []
    calls = [ToolCallStream() for _ in payloads]  # a held reply's calls, sent as they are written
    async for i, event in generation.follow([p.id for p in payloads]):
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TokenEvent):
            completion_tokens += 1
            events = held.release(i, event)
            if held.holding(i):
                for call in calls[i].feed(event.text):
                    yield frame(i, call_delta(call))
            text = "".join(e.text for e in events)
            if text or (events and logprobs is not None):
                yield frame(i, {"content": text}, _chat_logprobs(tokenizer, events) if logprobs is not None else None)
        elif isinstance(event, FinalEvent):
            finals.append(event)
            reason = stream_reason(event)
            if held.holding(i):  # read whole, as the reply without stream is
                reply = body.reply(held.text(i), reason)
                if not calls[i].calls:  # its calls went out as written; else its answer, whole, now
                    for delta in _tool_deltas(reply):
                        yield frame(i, delta)
                reason = reply.finish_reason
            yield frame(i, {}, None, reason)
    if usage_on:
        yield json_frame({**base, "choices": [], "usage": _usage(len(payloads[0].prompt_token_ids), completion_tokens,
                                                                 finals)})
    yield DONE


class HeldReplies:
    """With tools, a reply's text is held to the end and read whole (ChatCompletionRequest.reply);
    its tool calls meanwhile stream as they are written (api/tool_stream.py). In the Hermes format
    a reply that does not open with "<" is a plain answer to its end (hermes.parse reads it so),
    so it streams from there on. Its first character decides, once: None until then."""

    def __init__(self, body: ChatCompletionRequest, n: int):
        self.tools = body.calls_tools
        self.held: list[list[TokenEvent]] = [[] for _ in range(n)]
        self.answering: list[bool | None] = [None if body.hermes else False for _ in range(n)]

    def release(self, i: int, event: TokenEvent) -> list[TokenEvent]:
        """The events of reply i to stream now that `event` came (none while it is held)."""
        if not self.holding(i):
            return [event]
        self.held[i].append(event)
        if self.answering[i] is None and event.text:
            self.answering[i] = not self.text(i).startswith("<")
        if not self.answering[i]:
            return []
        events, self.held[i] = self.held[i], []
        return events

    def holding(self, i: int) -> bool:
        return self.tools and not self.answering[i]

    def text(self, i: int) -> str:
        return "".join(e.text for e in self.held[i])


def call_delta(call: CallDelta) -> dict:
    """A tool call's delta as OpenAI streams it: its id and name first, then its arguments' characters."""
    if call.name is not None:
        return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}]}
    return {"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]}


def _tool_deltas(reply: Reply) -> list[dict]:
    """A held reply as stream deltas, as OpenAI sends them: each tool call's id and name, then
    its arguments, by index; or the answer's content (none for a cut call)."""
    if not reply.tool_calls:
        return [{"content": reply.content}] if reply.content else []
    deltas = []
    for index, call in enumerate(reply.tool_calls):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas
