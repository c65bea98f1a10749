"""The pooling endpoints: /v1/embeddings (OpenAI's) and /v1/rerank (llama.cpp's and vLLM's shape;
also at /rerank and /v1/reranking, as llama.cpp answers). api/openai/pooling/inputs.py says what they compute."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from api.openai.pooling import inputs as pooling
from api.core.auth import AdmittedDep
from api.core.deps import ModelsDep, SettingsDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import OpenAIError
from api.openai.pooling import encoders
from api.openai.pooling.answers import EmbeddingList, Rerank, ScoreList
from api.openai.pooling.schemas import EmbeddingRequest, RerankRequest, ScoreRequest

router = APIRouter(tags=["pooling"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking")
PATHS = ("/v1/embeddings", "/v1/score", *RERANK_PATHS)


@router.post("/v1/embeddings", responses=json_answer(EmbeddingList, "One embedding per input."))
async def embeddings(body: EmbeddingRequest, served: ModelsDep, tenant: AdmittedDep, settings: SettingsDep,
                     request: Request):
    generation = await served.get(body.model)
    model = generation.tokenizer.pooling
    size = model.dimensions if model is not None and model.kind == "embed" else generation.tokenizer.hidden_size
    cut = body.dimensions is not None and body.dimensions != size
    if cut and (model is None or not model.matryoshka or body.dimensions > size):
        raise ApiError(400, f"dimensions is {body.dimensions}: this model's embeddings have {size} dimensions"
                            + ("" if model is not None and model.matryoshka and body.dimensions > size else
                               ", and it was not trained to be cut shorter (Matryoshka)"), param="dimensions")
    vectors, tokens = await pooling.embed(generation, body.inputs(), tenant, body.priority, _caps(settings), request,
                                          body.prompt_name)
    if cut:
        vectors = [encoders.truncate(pooling.floats(v), body.dimensions) for v in vectors]
        if body.encoding_format == "base64":
            vectors = [pooling.encode_floats(v) for v in vectors]
    data = [{"object": "embedding", "index": i,
             "embedding": vector if body.encoding_format == "base64" or cut else pooling.floats(vector)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": generation.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def rerank(body: RerankRequest, served: ModelsDep, tenant: AdmittedDep, settings: SettingsDep, request: Request):
    generation = await served.get(body.model)
    texts = body.texts()
    scores, tokens = await pooling.rerank(generation, body.query, texts, tenant, body.priority, _caps(settings),
                                          request)
    order = sorted(range(len(texts)), key=lambda i: scores[i], reverse=True)[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                             if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": generation.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


@router.post("/v1/score", responses=json_answer(ScoreList, "One score per pair, in order."))
async def score(body: ScoreRequest, served: ModelsDep, tenant: AdmittedDep, settings: SettingsDep, request: Request):
    """vLLM's score API: each pair's relevance, as /v1/rerank computes it (a cross-encoder's head,
    an embedding model's cosine, or a decoder's yes/no answer)."""
    try:
        pairs = body.pairs()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="text_2") from None
    caps = _caps(settings)
    caps.check_inputs(len(pairs), "text_2")
    generation = await served.get(body.model)
    by_query: dict[str, list[int]] = {}
    for i, (query, _) in enumerate(pairs):
        by_query.setdefault(query, []).append(i)
    scores, used = [0.0] * len(pairs), 0
    for query, indexes in by_query.items():  # one queued request per distinct text_1
        values, tokens = await pooling.rerank(generation, query, [pairs[i][1] for i in indexes], tenant,
                                              body.priority, caps, request)
        used += tokens
        for i, value in zip(indexes, values):
            scores[i] = value
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": generation.model_name, "usage": {"prompt_tokens": used, "total_tokens": used},
            "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)]}


def _caps(settings) -> pooling.Caps:
    return pooling.Caps(settings.max_pooling_inputs, settings.max_pooling_tokens)


for _path in RERANK_PATHS:
    router.add_api_route(_path, rerank, methods=["POST"], include_in_schema=_path == "/v1/rerank",
                         responses=json_answer(Rerank, "The documents, the most relevant first."))
