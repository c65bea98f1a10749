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
from dataclasses import dataclass

from starlette.requests import Request

from api.core.errors import ApiError
from api.core.generation import Generation
from api.openai.pooling import encoders
from shared.ids import request_id
from shared.messages import FinalEvent, FinishReason, PoolSpec, RequestPayload, now
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer

POOLING_BACKEND = "hf"  # the paged engine's: the workers that run pooling requests (worker/engine/pooling.py)
# The question a rerank score answers. Of five wordings tried on the default model (10 hand-written
# queries of 4 documents, one relevant: benchmarks/embeddings.py), this one put the relevant document
# first for 7 (Qwen3-Reranker's system-and-tags prompt: 5; a plain "<Query>/<Document>" one: 3).
RERANK_QUESTION = "Document: {document}\nQuestion: {query}\nIs this document relevant to the question? Reply with yes or no."
_MARK = "\x00document\x00"  # where the document goes in the rendered template (the first one: a query comes after)


@dataclass(frozen=True)
class Caps:
    """The most one pooling request may ask for (STREAMQ_MAX_POOLING_INPUTS, _TOKENS): past either, 413."""

    inputs: int
    tokens: int

    def check_inputs(self, n: int, param: str) -> None:
        if n > self.inputs:
            raise ApiError(413, f"{param} has {n} items; this server runs at most {self.inputs} in one request",
                           param=param, code="too_many_inputs")

    def check_tokens(self, n: int, param: str) -> None:
        if n > self.tokens:
            raise ApiError(413, f"{param} comes to more than {self.tokens} tokens for the model to run (at least {n}); "
                                f"this server runs at most {self.tokens} in one request", param=param,
                           code="too_many_tokens")


async def embed(generation: Generation, inputs: list[str | list[int]], tenant: str, priority: int, caps: Caps,
                request: Request | None = None, prompt_name: str | None = None) -> tuple[list[str], int]:
    """Each input's embedding (base64 float32) and the tokens they took."""
    caps.check_inputs(len(inputs), "input")
    model = generation.tokenizer.pooling
    if model is None and prompt_name is not None:
        raise ApiError(400, f"prompt_name: {generation.model_name!r} has no named prompts (an embedding model's "
                            "sentence-transformers files give them)", param="prompt_name")
    if model is not None:
        encoders.check_task(generation, "embed", "/v1/embeddings")
        if prompt_name is not None and not all(isinstance(item, str) for item in inputs):
            raise ApiError(400, "prompt_name goes before texts; token-id inputs are taken whole",
                           param="prompt_name")
    prompt = encoders.prompt_of(model, prompt_name) if model is not None else ""
    ids, total = [], 0
    for i, item in enumerate(inputs):  # stops at the cap, before tokenizing the rest
        ids.append(await _tokens(generation, item, i, prompt))
        total += len(ids[-1])
        caps.check_tokens(total, "input")
    if model is None:
        spec = PoolSpec(task="embed", lengths=[len(x) for x in ids])
    else:
        skip = await generation.tokenize(encoders.prompt_skip, generation, prompt, param="prompt_name")
        spec = encoders.spec_for_embed(ids, [skip if isinstance(item, str) else 0 for item in inputs])
    return await _run(generation, ids, spec, tenant, priority, request)


async def rerank(generation: Generation, query: str, documents: list[str], tenant: str, priority: int, caps: Caps,
                 request: Request | None = None) -> tuple[list[float], int]:
    """Each document's relevance score to `query` (0 to 1 on a decoder) and the tokens they took.
    The query and the prompt around each document are tokenized and queued once (PoolSpec head
    and tail). An encoder scores with its classification head (a cross-encoder) or by cosine (an
    embedding model): api/openai/pooling/encoders.py."""
    caps.check_inputs(len(documents), "documents")
    model = generation.tokenizer.pooling
    if model is not None and model.kind == "embed":
        return await _cosine_rerank(generation, model, query, documents, tenant, priority, caps, request)
    if model is not None and model.num_labels != 1:
        raise ApiError(400, f"{generation.model_name!r} is a cross-encoder of {model.num_labels} labels; a relevance "
                            "score needs one", param="model", code="pooling_not_supported")
    tok = generation.tokenizer
    if model is None:
        head, tail = await generation.tokenize(rerank_frame, tok, query, param="query")
    else:
        head, tail = (await generation.tokenize(tok.pair_frame, query, documents[0], param="query"))[0], []
    caps.check_tokens(len(documents) * (len(head) + len(tail)), "documents")
    if model is None:
        bodies = await generation.tokenize(lambda: [rerank_body(tok, doc) for doc in documents], param="documents")
    else:
        bodies = (await generation.tokenize(encoders.pair_inputs, generation, query, documents, param="documents"))[1]
    for i, ids in enumerate(bodies):
        _check_length(generation, head + ids + tail, f"documents[{i}]")
    spec = PoolSpec(task="score", lengths=[len(x) for x in bodies], candidates=rerank_candidates(tok),
                    head=head, tail=tail) if model is None else \
        PoolSpec(task="classify", lengths=[len(x) for x in bodies], head=head)
    caps.check_tokens(spec.prompt_tokens(), "documents")
    pooled, tokens = await _run(generation, bodies, spec, tenant, priority, request)
    return [floats(value)[0] for value in pooled], tokens


async def _cosine_rerank(generation: Generation, model, query: str, documents: list[str], tenant: str,
                         priority: int, caps: Caps, request: Request | None) -> tuple[list[float], int]:
    """An embedding model's scores: the cosine of the query's embedding and each document's, in one
    request (the query first), each with its named prompt where the model has one."""
    prompts = [model.prompts.get("query", "")] + [model.prompts.get("document", "")] * len(documents)
    ids, total = [], 0
    for i, (prompt, text) in enumerate(zip(prompts, [query, *documents])):
        ids.append(await _tokens(generation, text, max(i - 1, 0), prompt, param="query" if i == 0 else "documents"))
        total += len(ids[-1])
        caps.check_tokens(total, "documents")
    by_prompt = {p: await generation.tokenize(encoders.prompt_skip, generation, p, param="documents")
                 for p in dict.fromkeys(prompts)}
    spec = encoders.spec_for_embed(ids, [by_prompt[p] for p in prompts])
    pooled, tokens = await _run(generation, ids, spec, tenant, priority, request)
    vectors = [floats(v) for v in pooled]
    return encoders.cosines(vectors[0], vectors[1:]), tokens


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob after the tokens before it, its rank there, and the likeliest
    tokens there (id, logprob), the most likely first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


async def prompt_logprobs(generation: Generation, prompts: list[list[int]], top: int, tenant: str, priority: int,
                          caps: Caps) -> tuple[list[list[PromptLogprob]], int]:
    """Each prompt's tokens scored by the model (one pooling request of task logprobs, every prompt
    an input): from the second token on, since the first has nothing before it."""
    caps.check_inputs(len(prompts), "prompt")
    caps.check_tokens(sum(map(len, prompts)), "prompt")
    pooled, tokens = await _run(generation, prompts, PoolSpec(task="logprobs", lengths=[len(p) for p in prompts],
                                                              top=top), tenant, priority, None)
    width, out = 2 + 2 * top, []
    for ids, encoded in zip(prompts, pooled):
        values = floats(encoded)
        rows = [values[i:i + width] for i in range(0, len(values), width)]
        assert len(rows) == max(len(ids) - 1, 0), "a logprob per prompt token after the first"
        out.append([PromptLogprob(r[0], int(r[1]), [(int(r[2 + 2 * j]), r[3 + 2 * j]) for j in range(top)])
                    for r in rows])
    return out, tokens


def encode_floats(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def floats(encoded: str) -> list[float]:
    raw = base64.b64decode(encoded)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


async def require_pooling(generation: Generation) -> None:
    """400 unless a live worker of the model runs pooling requests (the paged engine's do; the vLLM
    and null backends' and a static-batch worker's do not): queued, it would wait for nothing."""
    if generation.adapter is not None:
        raise ApiError(400, f"embeddings, rerank and prompt logprobs run on base models only; {generation.adapter!r} is a LoRA "
                            f"adapter of {generation.base_model!r}", param="model", code="pooling_not_supported")
    workers = await generation.live_workers()
    if not any(w.pools for w in workers):
        backends = sorted({w.backend for w in workers})
        raise ApiError(400, f"no live worker of {generation.model_name!r} computes embeddings, rerank scores or prompt "
                            "logprobs (echo, prompt_logprobs) "
                            f"(the built-in paged engine does; live backends: {backends})",
                       param="model", code="pooling_not_supported")


async def _run(generation: Generation, inputs: list[list[int]], spec: PoolSpec, tenant: str,
               priority: int, request: Request | None) -> tuple[list[str], int]:
    await require_pooling(generation)
    created = now()
    payload = RequestPayload(id=request_id(), model=generation.base_model,
                             prompt_token_ids=[t for ids in inputs for t in ids],
                             params=SamplingParams(max_tokens=1), created_at=created,
                             expires_at=created + generation.queue_timeout_s, priority=priority,
                             backend=POOLING_BACKEND, pool=spec)
    await generation.submit([payload], tenant=tenant)
    try:
        final = await _final_unless_gone(generation, payload.id, request)
    except asyncio.CancelledError:  # the client went away: the worker need not compute it
        await asyncio.shield(generation.cancel([payload]))
        raise
    if final is None:  # the client went away: nobody reads this answer
        await generation.cancel([payload])
        raise ApiError(409, "the client closed the connection; the request was cancelled", code="cancelled")
    if final.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"pooling failed: {final.error}")
    if final.finish_reason is FinishReason.EXPIRED:
        raise ApiError(503, final.error or "the request expired in the queue", code="expired")
    if final.finish_reason is FinishReason.CANCELLED or final.pooled is None:
        raise ApiError(409, "the request was cancelled before it ended", code="cancelled")
    return final.pooled, payload.num_prompt_tokens


async def _final_unless_gone(generation: Generation, request_id: str, request: Request | None) -> FinalEvent | None:
    """The request's final event, or None if the client disconnects first (the answer is not sent
    until the end, so the server hears of it only by watching the connection)."""
    if request is None:
        return await _final(generation, request_id)
    final, gone = asyncio.ensure_future(_final(generation, request_id)), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (final, gone):
            task.cancel()
        await asyncio.gather(final, gone, return_exceptions=True)
    return final.result() if final.done() and not final.cancelled() else None


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _final(generation: Generation, request_id: str) -> FinalEvent:
    async for _, event in generation.follow([request_id]):
        if isinstance(event, FinalEvent):
            return event
    raise ApiError(500, f"request {request_id} ended without its final event")


async def _tokens(generation: Generation, item: str | list[int], i: int, prompt: str = "",
                  param: str = "input") -> list[int]:
    if isinstance(item, str):
        if generation.tokenizer.pooling is not None:
            ids = await generation.tokenize(encoders.encode_text, generation, prompt, item, param=param)
        else:
            ids = await generation.tokenize(generation.tokenizer.encode, item, param=param)
    else:
        vocab = generation.tokenizer.vocab_size
        if bad := [t for t in item if not 0 <= t < vocab]:
            raise ApiError(400, f"{param}[{i}]: token ids {bad[:5]} are outside the vocabulary (0 to {vocab - 1})",
                           param=param)
        ids = list(item)
    _check_length(generation, ids, f"{param}[{i}]")
    return ids


def _check_length(generation: Generation, ids: list[int], name: str) -> None:
    context = generation.tokenizer.context_length
    if not ids:
        raise ApiError(400, f"{name} encodes to no tokens", param=name.split("[")[0])
    if len(ids) > context:
        raise ApiError(400, f"{name} has {len(ids)} tokens; the model's context is {context} tokens",
                       param=name.split("[")[0])


def rerank_prompt(tok: Tokenizer, query: str, document: str) -> list[int]:
    """The prompt whose next token answers yes or no: a user turn of the chat template, where the
    model has one."""
    head, tail = rerank_frame(tok, query)
    return head + rerank_body(tok, document) + tail


def rerank_frame(tok: Tokenizer, query: str) -> tuple[list[int], list[int]]:
    """The tokens before and after a document in the rerank prompt (the query lies in the tail),
    tokenized apart from it: the split falls where a word begins, so the tokens are those of the
    whole prompt for byte-level BPE tokenizers (a SentencePiece one may differ at the two seams)."""
    before, after = RERANK_QUESTION.split("{document}")
    question = before.rstrip(" ") + _MARK + after.format(query=query)
    if tok.chat_template:
        text = tok.render_chat([{"role": "user", "content": question}])
        head, tail = text.split(_MARK, 1)
        return tok.encode(head, add_special_tokens=False), tok.encode(tail, add_special_tokens=False)
    head, tail = f"{question}\nAnswer:".split(_MARK, 1)
    return tok.encode(head), tok.encode(tail, add_special_tokens=False)


def rerank_body(tok: Tokenizer, document: str) -> list[int]:
    """A document's tokens in the rerank prompt: with the space that parts it from its label."""
    return tok.encode(" " + document, add_special_tokens=False)


def rerank_candidates(tok: Tokenizer) -> list[int]:
    """The tokens of "yes" and "no" as the answer's first token."""
    spaced = "" if tok.chat_template else " "  # after "Answer:" the word comes with its space
    return [tok.encode(spaced + word, add_special_tokens=False)[0] for word in ("yes", "no")]

