"""`POST /v1/chat/completions`: each of the `n` samples is one queued request, followed through
the relay; a streaming client that disconnects cancels them. Replies are read through the
output parsers (api/core/parsers/): with tools, a reply's calls stream as they are written."""
from __future__ import annotations

import contextlib
import time
from typing import Any
from collections.abc import AsyncIterator

from fastapi import APIRouter

from api.core.auth import AdmittedDep
from api.core.choice import finish_reason, stream_reason
from api.core.deps import ModelsDep, StreamsDep
from api.core.generation import Generation, Prompt
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_or_stream
from api.core.parsers.base import CallDelta, Reply
from api.core.parsers.reply import ReplyParser, read_whole
from api.core.sse import OPENAI, EventStreamResponse
from api.openai.answers import CHAT_EVENTS, CHAT_EVENTS_EXAMPLE, ChatCompletion, OpenAIError
from api.openai.logprobs import chat_logprobs, usage
from api.openai.schemas import ChatCompletionRequest
from shared import ids
from shared.messages import FinalEvent, RequestPayload, TokenEvent
from shared.tokenizer import Tokenizer

router = APIRouter(tags=["openai"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))


@router.post("/v1/chat/completions", responses=json_or_stream(
    ChatCompletion, "The chat completion.", CHAT_EVENTS, CHAT_EVENTS_EXAMPLE))
async def chat_completions(body: ChatCompletionRequest, served: ModelsDep, tenant: AdmittedDep, streams: StreamsDep):
    generation = await served.get(body.model)
    tokenizer = generation.tokenizer
    prompt = body.as_prompt(generation.tool_format)
    payloads = await generation.payloads(prompt, tenant)
    # A stream's slot, before its request is queued: a 429 leaves nothing behind.
    async with streams.opening(tenant) if body.stream else contextlib.nullcontext() as slot:
        await generation.submit(payloads, tenant=tenant)
    prompt_ids = payloads[0].prompt_token_ids
    rid, created, model = ids.chat_completion_id(), int(time.time()), generation.model_name
    if body.stream:
        events = _stream_chat(generation, tokenizer, body, prompt, payloads, rid, created, model)
        return EventStreamResponse(events, slot, on_disconnect=lambda: generation.cancel(payloads))
    choices = await generation.collect(payloads)
    out, thought_tokens = [], 0
    for i, c in enumerate(choices):
        if prompt.reasoning is not None:  # the thought's tokens, counted as a stream counts them
            counter = ReplyParser(None, prompt.reasoning)
            for text in c.text:
                counter.feed(text)
            thought_tokens += counter.thought_tokens
        reply = read_whole(prompt.tool_format, "".join(c.text), finish_reason(c.final), prompt.reasoning)
        out.append({"index": i, "message": _message(reply, thinks=prompt.reasoning is not None),
                    "logprobs": chat_logprobs(tokenizer, c.tokens) if prompt.logprobs is not None else None,
                    "finish_reason": reply.finish_reason})
    totals = usage(len(prompt_ids), sum(len(c.tokens) for c in choices), [c.final for c in choices])
    if prompt.reasoning is not None:
        totals["completion_tokens_details"] = {"reasoning_tokens": thought_tokens}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": totals, "service_tier": payloads[0].service_tier}


def _message(reply: Reply, thinks: bool = False) -> dict:
    """The assistant message of a reply: its calls, or its answer; and where the model thinks
    aloud, its thought (None where it wrote none)."""
    thought = {"reasoning_content": reply.reasoning, "reasoning": reply.reasoning} if thinks else {}
    if reply.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": reply.tool_calls, **thought}
    return {"role": "assistant", "content": reply.content, **thought}


def _thought(text: str) -> dict:
    """A piece of the thought as a stream delta, by both of vLLM's names."""
    return {"reasoning_content": text, "reasoning": text}


async def _stream_chat(generation: Generation, tokenizer: Tokenizer, body: ChatCompletionRequest, prompt: Prompt,
                       payloads: list[RequestPayload], rid: str, created: int, model: str) -> AsyncIterator[str]:
    logprobs = prompt.logprobs
    usage_on = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "service_tier": payloads[0].service_tier}
    extra = {"usage": None} if usage_on else {}

    def frame(i: int, delta: dict, lp: Any = None, reason: str | None = None) -> str:
        return OPENAI.event({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                           **extra})

    for i in range(len(payloads)):
        yield frame(i, {"role": "assistant", "content": ""})
    completion_tokens, finals = 0, []
    replies = [ReplyParser(prompt.tool_format, prompt.reasoning) for _ in payloads]
    held: list[list[TokenEvent]] = [[] for _ in payloads]  # each reply's tokens not streamed yet
    async for i, event in generation.follow([p.id for p in payloads]):
        if event is None:
            yield OPENAI.keepalive
        elif isinstance(event, TokenEvent):
            completion_tokens += 1
            deltas = replies[i].feed(event.text)
            held[i].append(event)
            for delta in deltas:
                if delta.reasoning:
                    yield frame(i, _thought(delta.reasoning))
                elif delta.call is not None:  # a held reply's calls go out as they are written
                    yield frame(i, call_delta(delta.call))
            if replies[i].holding:
                continue
            events, held[i] = held[i], []
            text = "".join(d.content for d in deltas)
            if text or (events and logprobs is not None):
                yield frame(i, {"content": text}, chat_logprobs(tokenizer, events) if logprobs is not None else None)
        elif isinstance(event, FinalEvent):
            finals.append(event)
            reason = stream_reason(event)
            for delta in replies[i].flush():  # what the reasoning stage kept back
                if delta.reasoning:
                    yield frame(i, _thought(delta.reasoning))
                elif delta.content and not replies[i].holding:
                    yield frame(i, {"content": delta.content})
            if replies[i].holding:  # read whole, as the reply without stream is
                reply = replies[i].finish(reason)
                if not replies[i].calls:  # its calls went out as written; else its answer, whole, now
                    for delta in _tool_deltas(reply):
                        yield frame(i, delta)
                reason = reply.finish_reason
            yield frame(i, {}, None, reason)
    if usage_on:
        totals = usage(len(payloads[0].prompt_token_ids), completion_tokens, finals)
        if prompt.reasoning is not None:
            totals["completion_tokens_details"] = {"reasoning_tokens": sum(r.thought_tokens for r in replies)}
        yield OPENAI.event({**base, "choices": [], "usage": totals})
    yield OPENAI.last


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
