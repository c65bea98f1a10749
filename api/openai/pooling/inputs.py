"""Pooling requests (embeddings, rerank scores) as the routes build and answer them: the inputs of
one HTTP request go back to back into ONE queued request (RequestPayload.pool), which a worker of
the paged engine runs in its steps beside generation and answers in its final event.

Embeddings are the served model's final hidden states, mean-pooled over each input's tokens and
scaled to length 1 (the model is a generative one, not trained as an embedding model). A rerank
score is the model's probability of "yes" over "yes" + "no" as the first answer token to a
prompt asking whether the document is relevant to the question (RERANK_QUESTION), as LLM-based
rerankers such as Qwen3-Reranker score.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import uuid

from starlette.concurrency import run_in_threadpool

from api.core.errors import ApiError
from api.core.generation import Generation
from shared.messages import FinalEvent, FinishReason, PoolSpec, RequestPayload, now
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer

POOLING_BACKEND = "hf"  # the paged engine's: the workers that run pooling requests (worker/engine/pooling.py)
# The question a rerank score answers. Of five wordings tried on the default model (10 hand-written
# queries of 4 documents, one relevant: benchmarks/embeddings.py), this one put the relevant document
# first for 7 (Qwen3-Reranker's system-and-tags prompt: 5; a plain "<Query>/<Document>" one: 3).
RERANK_QUESTION = "Document: {document}\nQuestion: {query}\nIs this document relevant to the question? Reply with yes or no."


async def embed(generation: Generation, inputs: list[str | list[int]], tenant: str, priority: int) -> tuple[list[str], int]:
    """Each input's embedding (base64 float32) and the tokens they took."""
    ids = [await _tokens(generation, item, i) for i, item in enumerate(inputs)]
    return await _run(generation, ids, PoolSpec(task="embed", lengths=[len(x) for x in ids]), tenant, priority)


async def rerank(generation: Generation, query: str, documents: list[str], tenant: str,
                 priority: int) -> tuple[list[float], int]:
    """Each document's relevance score to `query` (0 to 1) and the tokens they took."""
    prompts = await run_in_threadpool(lambda: [_rerank_prompt(generation, query, doc) for doc in documents])
    for i, ids in enumerate(prompts):
        _check_length(generation, ids, f"documents[{i}]")
    spec = PoolSpec(task="score", lengths=[len(x) for x in prompts], candidates=rerank_candidates(generation.tokenizer))
    pooled, tokens = await _run(generation, prompts, spec, tenant, priority)
    return [floats(value)[0] for value in pooled], tokens


def floats(encoded: str) -> list[float]:
    raw = base64.b64decode(encoded)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


async def require_pooling(generation: Generation) -> None:
    """400 unless a live worker of the model runs pooling requests (the paged engine's do; the vLLM
    and null backends' and a static-batch worker's do not): queued, it would wait for nothing."""
    if generation.adapter is not None:
        raise ApiError(400, f"embeddings and rerank run on base models only; {generation.adapter!r} is a LoRA "
                            f"adapter of {generation.base_model!r}", param="model", code="pooling_not_supported")
    workers = await generation.live_workers()
    if not any(w.pools for w in workers):
        backends = sorted({w.backend for w in workers})
        raise ApiError(400, f"no live worker of {generation.model_name!r} computes embeddings or rerank scores "
                            f"(the built-in paged engine does; live backends: {backends})",
                       param="model", code="pooling_not_supported")


async def _run(generation: Generation, inputs: list[list[int]], spec: PoolSpec, tenant: str,
               priority: int) -> tuple[list[str], int]:
    await require_pooling(generation)
    created = now()
    payload = RequestPayload(id=str(uuid.uuid4()), model=generation.base_model,
                             prompt_token_ids=[t for ids in inputs for t in ids],
                             params=SamplingParams(max_tokens=1), created_at=created,
                             expires_at=created + generation.queue_timeout_s, priority=priority,
                             backend=POOLING_BACKEND, pool=spec)
    await generation.submit([payload], tenant=tenant)
    try:
        final = await _final(generation, payload.id)
    except asyncio.CancelledError:  # the client went away: the worker need not compute it
        await asyncio.shield(generation.cancel([payload]))
        raise
    if final.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"pooling failed: {final.error}")
    if final.finish_reason is FinishReason.EXPIRED:
        raise ApiError(503, final.error or "the request expired in the queue", code="expired")
    if final.finish_reason is FinishReason.CANCELLED or final.pooled is None:
        raise ApiError(409, "the request was cancelled before it ran", code="cancelled")
    return final.pooled, len(payload.prompt_token_ids)


async def _final(generation: Generation, request_id: str) -> FinalEvent:
    async for _, event in generation.follow([request_id]):
        if isinstance(event, FinalEvent):
            return event
    raise ApiError(500, f"request {request_id} ended without its final event")


async def _tokens(generation: Generation, item: str | list[int], i: int) -> list[int]:
    if isinstance(item, str):
        ids = await run_in_threadpool(generation.tokenizer.encode, item)
    else:
        vocab = generation.tokenizer.vocab_size
        if bad := [t for t in item if not 0 <= t < vocab]:
            raise ApiError(400, f"input[{i}]: token ids {bad[:5]} are outside the vocabulary (0 to {vocab - 1})",
                           param="input")
        ids = list(item)
    _check_length(generation, ids, f"input[{i}]")
    return ids


def _check_length(generation: Generation, ids: list[int], name: str) -> None:
    context = generation.tokenizer.context_length
    if not ids:
        raise ApiError(400, f"{name} encodes to no tokens", param=name.split("[")[0])
    if len(ids) > context:
        raise ApiError(400, f"{name} has {len(ids)} tokens; the model's context is {context} tokens",
                       param=name.split("[")[0])


def _rerank_prompt(generation: Generation, query: str, document: str) -> list[int]:
    return rerank_prompt(generation.tokenizer, query, document)


def rerank_prompt(tok: Tokenizer, query: str, document: str) -> list[int]:
    """The prompt whose next token answers yes or no: a user turn of the chat template, where the
    model has one."""
    question = RERANK_QUESTION.format(document=document, query=query)
    if tok.chat_template:
        return tok.encode_chat([{"role": "user", "content": question}])
    return tok.encode(f"{question}\nAnswer:")


def rerank_candidates(tok: Tokenizer) -> list[int]:
    """The tokens of "yes" and "no" as the answer's first token."""
    spaced = "" if tok.chat_template else " "  # after "Answer:" the word comes with its space
    return [tok.encode(spaced + word, add_special_tokens=False)[0] for word in ("yes", "no")]

