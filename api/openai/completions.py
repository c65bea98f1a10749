"""`POST /v1/completions`: each of a prompt's `n` (or `best_of`) samples is one queued request
(they share the prompt's KV blocks through the worker's prefix cache), for each of its prompts,
followed through the relay; a streaming client that disconnects cancels them."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from collections.abc import AsyncIterator

from fastapi import APIRouter

from api.core.auth import AdmittedDep
from api.core.choice import finish_reason, stream_reason
from api.core.deps import ModelsDep, SettingsDep, StreamsDep
from api.core.generation import Generation
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_or_stream
from api.core.sse import OPENAI, EventStreamResponse
from api.openai.answers import COMPLETION_EVENTS, COMPLETION_EVENTS_EXAMPLE, Completion, OpenAIError
from api.openai.logprobs import completion_logprobs, echo_logprobs, usage, vllm_prompt_logprobs
from api.openai.pooling import inputs as pooling
from api.openai.schemas import CompletionRequest
from shared import ids
from shared.messages import FinalEvent, RequestPayload, TokenEvent
from shared.tokenizer import Tokenizer

router = APIRouter(tags=["openai"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))


@router.post("/v1/completions", responses=json_or_stream(
    Completion, "The completion.", COMPLETION_EVENTS, COMPLETION_EVENTS_EXAMPLE))
async def completions(body: CompletionRequest, served: ModelsDep, tenant: AdmittedDep, streams: StreamsDep,
                      settings: SettingsDep):
    generation = await served.get(body.model)
    tokenizer = generation.tokenizer
    groups = [await generation.payloads(prompt, tenant) for prompt in body.as_prompts()]
    payloads = [p for group in groups for p in group] if body.max_tokens != 0 else []
    if body.scores_prompt:
        await pooling.require_pooling(generation)  # before anything is queued
    scored: list[list[pooling.PromptLogprob]] | None = None
    if body.stream and body.scores_prompt:  # a stream opens with the prompt: scored before anything else runs
        scored = await _score(generation, body, groups, tenant, settings)
    # A stream's slot, before its request is queued: a 429 leaves nothing behind.
    async with streams.opening(tenant) if body.stream else contextlib.nullcontext() as slot:
        await generation.submit(payloads, tenant=tenant)
    prompt_tokens = sum(len(group[0].prompt_token_ids) for group in groups)
    samples = body.samples_per_prompt
    rid, created, model = ids.completion_id(), int(time.time()), generation.model_name
    if body.stream:
        opening = [_opening(tokenizer, body, p, group[0].prompt_token_ids, scored[p] if scored else None)
                   for p, group in enumerate(groups)] if body.echo or body.prompt_logprobs is not None else None
        events = _stream_completion(generation, tokenizer, body, payloads, prompt_tokens, rid, created, model,
                                    groups[0][0].service_tier, opening)
        return EventStreamResponse(events, slot, on_disconnect=lambda: generation.cancel(payloads))
    if body.scores_prompt:  # beside the generation, in the workers' pooling steps
        try:
            scored = await _score(generation, body, groups, tenant, settings)
        except BaseException:
            await asyncio.shield(generation.cancel(payloads))
            raise
    choices = await generation.collect(payloads) if payloads else []
    out, finals = [], []
    for p, group in enumerate(groups):  # prompt by prompt: each prompt's n best of its samples
        mine = choices[p * samples:(p + 1) * samples]
        order = list(range(body.n))
        if mine and samples > body.n:
            order = sorted(range(samples), key=lambda i: mine[i].cumulative_logprob, reverse=True)[:body.n]
        prompt_ids = group[0].prompt_token_ids
        echoed = _prompt_text(tokenizer, body.prompts()[p], prompt_ids) if body.echo else ""
        for j, i in enumerate(order):
            c = mine[i] if mine else None
            tokens = c.tokens if c is not None else []
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(tokenizer, tokens, len(echoed))
                if body.echo:
                    lp = _joined(echo_logprobs(tokenizer, prompt_ids, scored[p], body.logprobs), lp)
            choice = {"index": p * body.n + j, "text": echoed + ("".join(c.text) if c is not None else ""),
                      "logprobs": lp, "finish_reason": finish_reason(c.final) if c is not None else "length"}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt_ids, scored[p], body.prompt_logprobs)
            out.append(choice)
        finals.append([c.final for c in mine])
    totals = usage(prompt_tokens, sum(len(c.tokens) for c in choices), *finals)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out, "usage": totals,
            "service_tier": groups[0][0].service_tier}


async def _score(generation: Generation, body: CompletionRequest, groups: list[list[RequestPayload]], tenant: str,
                 settings) -> list[list[pooling.PromptLogprob]]:
    """Each prompt's tokens scored (one pooling request of task logprobs, every prompt an input)."""
    top = max(body.logprobs or 0, body.prompt_logprobs or 0)
    caps = pooling.Caps(settings.max_pooling_inputs, settings.max_pooling_tokens)
    scored, _ = await pooling.prompt_logprobs(generation, [g[0].prompt_token_ids for g in groups], top, tenant,
                                              body.priority, caps)
    return scored


def _opening(tokenizer: Tokenizer, body: CompletionRequest, p: int, prompt_ids: list[int],
             scored: list[pooling.PromptLogprob] | None) -> dict[str, Any]:
    """A stream's first piece of each of prompt p's choices: the echoed prompt and its logprobs,
    and vLLM's prompt_logprobs, as the whole answer gives them."""
    echoed = _prompt_text(tokenizer, body.prompts()[p], prompt_ids) if body.echo else ""
    out: dict[str, Any] = {"text": echoed, "logprobs": None}
    if body.echo and body.logprobs is not None:
        out["logprobs"] = echo_logprobs(tokenizer, prompt_ids, scored, body.logprobs)
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt_ids, scored, body.prompt_logprobs)
    return out


def _prompt_text(tokenizer: Tokenizer, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The prompt as echo gives it back: its text, or its token ids decoded (special tokens kept)."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


async def _stream_completion(generation: Generation, tokenizer: Tokenizer, body: CompletionRequest,
                             payloads: list[RequestPayload], prompt_tokens: int, rid: str, created: int,
                             model: str, tier: str, opening: list[dict[str, Any]] | None) -> AsyncIterator[str]:
    """Each request's tokens as its choice's chunks (with no best_of, request i is choice i); where
    `opening` (each prompt's echo and prompt logprobs) is given, each choice opens with its prompt's,
    and with max_tokens 0 that is all it has."""
    usage_on = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": rid, "object": "text_completion", "created": created, "model": model, "service_tier": tier}
    extra = {"usage": None} if usage_on else {}
    samples = body.samples_per_prompt
    count = len(opening) * samples if opening is not None else len(payloads)
    offsets = [len(opening[i // samples]["text"]) if opening else 0 for i in range(count)]
    for i in range(count if opening is not None else 0):
        yield OPENAI.event({**base, "choices": [{"index": i, **opening[i // samples], "finish_reason": None}], **extra})
    completion_tokens, finals = 0, [[] for _ in range(count // samples)]  # each prompt's samples'
    async for i, event in generation.follow([p.id for p in payloads]) if payloads else _nothing():
        if event is None:
            yield OPENAI.keepalive
            continue
        choice: dict[str, Any] | None = None
        if isinstance(event, TokenEvent):
            completion_tokens += 1
            if not event.text and body.logprobs is None:
                continue
            lp = completion_logprobs(tokenizer, [event], offsets[i]) if body.logprobs is not None else None
            offsets[i] += len(event.text)
            choice = {"index": i, "text": event.text, "logprobs": lp, "finish_reason": None}
        elif isinstance(event, FinalEvent):
            finals[i // samples].append(event)
            choice = {"index": i, "text": "", "logprobs": None, "finish_reason": stream_reason(event)}
        if choice is not None:
            yield OPENAI.event({**base, "choices": [choice], **extra})
    if not payloads:  # max_tokens 0: the prompt was all
        for i in range(count):
            yield OPENAI.event({**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                                     "finish_reason": "length"}], **extra})
    if usage_on:
        yield OPENAI.event({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, *finals)})
    yield OPENAI.last


async def _nothing() -> AsyncIterator[tuple[int, Any]]:
    return
    yield
