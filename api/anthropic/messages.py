"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request runs as the chat request it reads as (api/anthropic/schemas.py), through the
same queue, relay and failover, and answers in Anthropic's shapes: a `message` object, or a
stream of its named events (message_start, content_block_start / _delta / _stop, ping,
message_delta, message_stop; an `error` event for a request that fails); a tool call's input
streams as `input_json_delta` pieces as the model writes it (api/core/parsers/tool_stream.py). Errors take
Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, with the HTTP status.
Keys come as `x-api-key` or `Authorization: Bearer` (api/core/auth.py).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from typing import Any
from collections.abc import AsyncIterator

from fastapi import APIRouter

from api.anthropic.answers import MESSAGE_EVENTS, MESSAGE_EVENTS_EXAMPLE, AnthropicError, MessageAnswer, TokenCount
from api.anthropic.schemas import CountTokensRequest, MessagesRequest
from api.core.auth import AdmittedDep, TenantDep
from api.core.choice import Choice, finish_reason
from api.core.deps import ModelsDep, StreamsDep
from api.core.errors import ApiError
from api.core.generation import Generation, Prompt
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer, json_or_stream
from api.core.sse import ANTHROPIC, EventStreamResponse
from api.core.parsers.base import Delta, Reply
from api.core.parsers.reply import ReplyParser, read_whole
from shared import ids
from shared.messages import FinalEvent, RequestPayload, TokenEvent
from shared.tokenizer import Tokenizer

router = APIRouter(tags=["anthropic"], route_class=StrictJSONRoute,
                   responses=errors(AnthropicError, "Anthropic's error body."))
PATHS = ("/v1/messages",)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@router.post("/v1/messages/count_tokens", responses=json_answer(TokenCount, "The prompt's tokens."))
async def count_tokens(body: CountTokensRequest, served: ModelsDep, tenant: TenantDep):
    """The prompt's tokens as the model's chat template renders it, tools included."""
    generation = await served.get(body.model)
    prompt = body.chat_request(max_tokens=1).as_prompt(generation.tool_format)
    payloads = await generation.payloads(prompt, tenant, compile=False)  # counted, never run
    return {"input_tokens": len(payloads[0].prompt_token_ids)}


@router.post("/v1/messages", responses=json_or_stream(MessageAnswer, "The assistant's message.", MESSAGE_EVENTS,
                                                       MESSAGE_EVENTS_EXAMPLE))
async def messages(body: MessagesRequest, served: ModelsDep, tenant: AdmittedDep, streams: StreamsDep):
    generation = await served.get(body.model)
    prompt = body.chat().as_prompt(generation.tool_format)
    prompt.thinking_param = "thinking"
    payloads = await generation.payloads(prompt, tenant)
    if body.thinking is not None and body.thinking.type == "disabled":
        _thinking_off(generation, prompt)
    # A stream's slot, before its request is queued: a 429 leaves nothing behind.
    async with streams.opening(tenant) if body.stream else contextlib.nullcontext() as slot:
        await generation.submit(payloads, tenant=tenant)
    mid = ids.message_id()
    if body.stream:
        events = _stream(generation, prompt, body, payloads[0], mid)
        return EventStreamResponse(events, slot, on_disconnect=lambda: generation.cancel(payloads))
    choice = (await generation.collect(payloads))[0]
    reply = read_whole(prompt.tool_format, "".join(choice.text), finish_reason(choice.final), prompt.reasoning)
    stop_reason, stop_sequence = _stop(reply, choice, body.stop_sequences, generation.tokenizer)
    return {"id": mid, "type": "message", "role": "assistant", "model": generation.model_name,
            "content": _blocks(reply), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(choice.final, len(payloads[0].prompt_token_ids), len(choice.tokens), payloads[0].service_tier)}


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    """A reply's content blocks: its thought, its text, then a tool_use block per call."""
    thought = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    return thought + blocks + [_tool_use(call) for call in reply.tool_calls]


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def _stop(reply: Reply, choice: Choice, stops: list[str] | None, tokenizer: Tokenizer) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the reply, if one did."""
    if reply.tool_calls:
        return "tool_use", None
    if reply.finish_reason == "length":
        return "max_tokens", None
    # The worker cut the text before the stop string it met: the tokens' whole text goes on with it.
    tail = tokenizer.decode([t.token_id for t in choice.tokens])[len("".join(choice.text)):]
    matched = next((s for s in stops or [] if tail.startswith(s)), None)
    return ("stop_sequence", matched) if matched else ("end_turn", None)


# The service tiers by Anthropic's names (flex, which waits behind the others, as its batch tier).
TIER_NAMES = {"priority": "priority", "default": "standard", "flex": "batch"}


def _usage(final: FinalEvent | None, prompt_tokens: int, output_tokens: int, tier: str) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those computed, cache_read_input_tokens those a worker
    took from its prefix cache or the shared KV tier (their sum is the prompt); the service tier
    that served it."""
    cached = final.usage.cached_tokens if final is not None else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "service_tier": TIER_NAMES[tier]}


def _event(kind: str, **data: Any) -> str:
    return ANTHROPIC.event({"type": kind, **data})


async def _stream(generation: Generation, prompt: Prompt, body: MessagesRequest,
                  payload: RequestPayload, mid: str) -> AsyncIterator[str]:
    prompt_tokens = len(payload.prompt_token_ids)
    yield _event("message_start", message={
        "id": mid, "type": "message", "role": "assistant", "model": generation.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(None, prompt_tokens, 0, payload.service_tier)})
    reply_parser = ReplyParser(prompt.tool_format, prompt.reasoning)
    choice, index, text_open, call_open, thinking = Choice(), 0, False, False, False
    async for _, event in generation.follow([payload.id]):
        if event is None:  # the hub's keepalive tick: Anthropic's ping
            yield ANTHROPIC.keepalive
        elif isinstance(event, TokenEvent):
            choice.tokens.append(event)
            choice.text.append(event.text)
            deltas = reply_parser.feed(event.text)
            # The thought first, a thinking block of its own, closed when the answer begins.
            frames, index, thinking = _thought_frames(deltas, index, thinking)
            for frame in frames:
                yield frame
            for call in (d.call for d in deltas if d.call is not None):  # a held reply's calls, as written
                if call.name is not None:
                    yield _event("content_block_start", index=index, content_block={
                        "type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                    call_open = True
                if call.arguments:
                    yield _event("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": call.arguments})
                if call.closed:
                    yield _event("content_block_stop", index=index)
                    index, call_open = index + 1, False
            if text := "".join(d.content for d in deltas):
                for frame in _text_frames(text, index, text_open):
                    yield frame
                text_open = True
        elif isinstance(event, FinalEvent):
            choice.final = event
            try:
                reason = finish_reason(event)
            except ApiError as exc:
                yield _event("error", error=anthropic_error(exc.status, exc.message)["error"])
                return
            rest = reply_parser.flush()  # what the reasoning stage kept back
            frames, index, thinking = _thought_frames(rest, index, thinking, end=True)
            for frame in frames:
                yield frame
            if (text := "".join(d.content for d in rest)) and not reply_parser.holding:
                for frame in _text_frames(text, index, text_open):
                    yield frame
                text_open = True
            reply = replace(reply_parser.finish(reason), reasoning=None)  # its thought went out already
            if call_open:  # a call cut by max_tokens: its input stays as far as it got
                yield _event("content_block_stop", index=index)
            elif reply_parser.holding and not reply_parser.calls:  # a held answer (tools, none called): whole, now
                for frame in _held_blocks(reply, index):
                    yield frame
            elif text_open:
                yield _event("content_block_stop", index=index)
            stop_reason, stop_sequence = _stop(reply, choice, body.stop_sequences, generation.tokenizer)
            # Cumulative counts: the cache's share of the prompt is known only now.
            yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         usage=_usage(event, prompt_tokens, len(choice.tokens), payload.service_tier))
            yield _event("message_stop")


def _text_frames(text: str, index: int, text_open: bool) -> list[str]:
    """A piece of the answer's text: its text block opened first where it is not yet."""
    start = [] if text_open else [_event("content_block_start", index=index, content_block={"type": "text", "text": ""})]
    return start + [_event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})]


def _thinking_off(generation: Generation, prompt: Prompt) -> None:
    """thinking disabled: the template rendered with enable_thinking false (MessagesRequest.chat);
    a 400 for a thinking model whose template has no such switch. (enabled is a budget:
    Generation.payloads applies it, as chat completions' thinking_token_budget.)"""
    template = generation.tokenizer.chat_template or ""
    if prompt.reasoning is not None and ("enable_thinking" not in template or prompt.reasoning.opened):
        raise ApiError(400, "thinking.type disabled: this model thinks aloud and its chat template has no "
                            "enable_thinking to turn it off", param="thinking")


def _thought_frames(deltas: list[Delta], index: int, thinking: bool,
                    end: bool = False) -> tuple[list[str], int, bool]:
    """The frames of the thought's pieces among these deltas, then the next block's index and
    whether the thinking block is still open: it opens at the thought's first piece and closes
    (with an empty signature: none is made here) at the first piece of anything else, or at `end`."""
    frames = []
    for delta in deltas:
        if delta.reasoning:
            if not thinking:
                frames.append(_event("content_block_start", index=index,
                                     content_block={"type": "thinking", "thinking": "", "signature": ""}))
                thinking = True
            frames.append(_event("content_block_delta", index=index,
                                 delta={"type": "thinking_delta", "thinking": delta.reasoning}))
        elif thinking and (delta.content or delta.call is not None):
            frames += _close_thought(index)
            index, thinking = index + 1, False
    if thinking and end:
        frames += _close_thought(index)
        index, thinking = index + 1, False
    return frames, index, thinking


def _close_thought(index: int) -> list[str]:
    return [_event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""}),
            _event("content_block_stop", index=index)]


def _held_blocks(reply: Reply, first: int) -> list[str]:
    frames = []
    for index, block in enumerate(_blocks(reply), start=first):
        if block["type"] == "text":
            frames.append(_event("content_block_start", index=index, content_block={"type": "text", "text": ""}))
            frames.append(_event("content_block_delta", index=index, delta={"type": "text_delta",
                                                                            "text": block["text"]}))
        else:
            frames.append(_event("content_block_start", index=index,
                                 content_block={**block, "input": {}}))
            frames.append(_event("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        frames.append(_event("content_block_stop", index=index))
    return frames
