"""The seed tutorials' endpoints, with their request and response shapes, on the real path.

First tutorial (a hand-built server): /basic_generate, /generate (a batch of prompts),
/generate_stream (SSE `data: {"token", "sequence_id"}`), /generate_vllm. Second tutorial
(vLLM + FastAPI): /generate/ ({"query"} → {"response"}) and /generate_stream/, which streams
plain text. All of them queue their prompts in Redis like any request, so the worker batches
them with everything else; `/generate_vllm` goes to a vLLM-backed worker when one is live for
the model, and to whatever backend the workers run otherwise.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from api.core.auth import AdmittedDep
from api.core.deps import GenerationDep, StreamsDep
from api.core.errors import ApiError
from api.core.generation import Generation
from api.core.json_body import StrictJSONRoute
from api.core.sse import NATIVE, EventStreamResponse, frame
from api.core.openapi import json_answer, stream_answer
from api.native.answers import SEED_EVENTS, SEED_EVENTS_EXAMPLE, GeneratedText, GeneratedTexts, QueryAnswer, VllmTexts
from shared.messages import FinalEvent, FinishReason, RequestPayload, TokenEvent
from shared.sampling import MAX_SEED, MAX_TOKEN_ID, SamplingParams, seed_for

router = APIRouter(tags=["seed tutorials"], route_class=StrictJSONRoute)

# The first tutorial generated 50 new tokens greedily (transformers' generate defaults);
# its vLLM path sampled with temperature 0.7 and top_p 0.95.
SEED_MAX_TOKENS = 50
GREEDY = SamplingParams(temperature=0.0, max_tokens=SEED_MAX_TOKENS)
VLLM_LIKE = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=SEED_MAX_TOKENS)


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1)


class BatchGenerateRequest(BaseModel):
    prompts: list[str] = Field(max_length=256)


class QueryRequest(BaseModel):
    query: str = Field(min_length=1)
    # Sent back as the X-Request-Id header: printable ASCII only, or the response cannot be sent.
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")
    n: int = Field(1, ge=1, le=16)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    temperature: float = Field(0.7, ge=0.0, le=5.0)
    max_tokens: int = Field(256, ge=1, le=MAX_TOKEN_ID)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)


async def _texts(generation: Generation, prompts: list[str], params: SamplingParams,
                 tenant: str, backend: str | None = None) -> tuple[list[str], list[str]]:
    """Queue every prompt at once (the worker batches them), then gather each one's text."""
    payloads = [generation.build(await generation.encode(p), params) for p in prompts]
    for payload in payloads:
        payload.backend = backend
    await generation.submit(payloads, tenant=tenant)
    texts = await asyncio.gather(*(_text(generation, p) for p in payloads))
    return list(texts), [p.id for p in payloads]


async def _text(generation: Generation, payload: RequestPayload) -> str:
    parts = []
    async for _, event in generation.follow([payload.id]):
        if isinstance(event, TokenEvent):
            parts.append(event.text)
        elif isinstance(event, FinalEvent) and event.finish_reason in (FinishReason.ERROR, FinishReason.EXPIRED):
            raise ApiError(503 if event.finish_reason == FinishReason.EXPIRED else 500, event.error or "failed")
    return "".join(parts)


@router.post("/basic_generate", responses=json_answer(GeneratedText, "The prompt and its continuation."))
async def basic_generate(body: GenerateRequest, generation: GenerationDep, tenant: AdmittedDep):
    texts, _ = await _texts(generation, [body.prompt], GREEDY, tenant)
    return {"generated_text": body.prompt + texts[0]}


@router.post("/generate", responses=json_answer(GeneratedTexts, "Each prompt and its continuation."))
async def generate(body: BatchGenerateRequest, generation: GenerationDep, tenant: AdmittedDep):
    texts, ids = await _texts(generation, body.prompts, GREEDY, tenant)
    return {"generated_texts": [p + t for p, t in zip(body.prompts, texts)], "request_ids": ids}


@router.post("/generate_vllm", responses=json_answer(VllmTexts, "Each prompt's continuation."))
async def generate_vllm(body: BatchGenerateRequest, generation: GenerationDep, tenant: AdmittedDep):
    vllm = "vllm" in await generation.live_backends()
    texts, _ = await _texts(generation, body.prompts, VLLM_LIKE, tenant, backend="vllm" if vllm else None)
    return {"generated_texts": texts}


@router.post("/generate_stream", response_class=EventStreamResponse, status_code=200,
             responses=stream_answer(SEED_EVENTS, SEED_EVENTS_EXAMPLE))
async def generate_stream(body: GenerateRequest, generation: GenerationDep, tenant: AdmittedDep, streams: StreamsDep):
    payload = generation.build(await generation.encode(body.prompt), GREEDY)
    async with streams.opening(tenant) as slot:  # before it is queued: a 429 leaves nothing behind
        await generation.submit([payload], tenant=tenant)

    async def events():
        async for _, event in generation.follow([payload.id]):
            if event is None:
                yield NATIVE.keepalive
            elif isinstance(event, TokenEvent) and event.text:
                yield frame(f'{{"token": {_json(event.text)}, "sequence_id": "{payload.id}"}}')

    return EventStreamResponse(events(), slot, on_disconnect=lambda: generation.cancel([payload]))


@router.post("/generate/", responses=json_answer(QueryAnswer, "The query's continuation."))
async def generate_query(body: QueryRequest, generation: GenerationDep, tenant: AdmittedDep):
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens,
                            seed=body.seed)
    texts, _ = await _texts(generation, [body.query], params, tenant)
    return {"response": texts[0]}


@router.post("/generate_stream/", response_class=PlainTextResponse, responses={200: {
    "description": "The text as it is generated (text/plain, streamed).",
    "content": {"text/plain": {"schema": {"type": "string"}, "example": " Paris is the capital of France."}}}})
async def generate_query_stream(body: QueryRequest, generation: GenerationDep, tenant: AdmittedDep):
    """Plain text as it is generated; with n > 1 the samples' texts follow one another."""
    prompt_ids = await generation.encode(body.query)
    payloads = [generation.build(prompt_ids, SamplingParams(
        temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens,
        seed=seed_for(body.seed, i))) for i in range(body.n)]
    await generation.submit(payloads, tenant=tenant)

    async def chunks():
        finished = False
        try:
            for payload in payloads:
                async for _, event in generation.follow([payload.id]):
                    if isinstance(event, TokenEvent) and event.text:
                        yield event.text
            finished = True
        finally:
            if not finished:  # the client went away: stop the work it asked for
                await asyncio.shield(generation.cancel(payloads))

    return StreamingResponse(chunks(), media_type="text/plain; charset=utf-8",
                             headers={"X-Request-Id": body.request_id or payloads[0].id})


def _json(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
