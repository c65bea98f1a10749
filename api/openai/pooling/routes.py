"""The pooling endpoints: /v1/embeddings (OpenAI's) and /v1/rerank (llama.cpp's and vLLM's shape;
also at /rerank and /v1/reranking, as llama.cpp answers). api/openai/pooling/inputs.py says what they compute."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from api.openai.pooling import inputs as pooling
from api.core.auth import AdmittedDep
from api.core.deps import ModelsDep, SettingsDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import OpenAIError
from api.openai.pooling.answers import EmbeddingList, Rerank
from api.openai.pooling.schemas import EmbeddingRequest, RerankRequest

router = APIRouter(tags=["pooling"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking")
PATHS = ("/v1/embeddings", *RERANK_PATHS)


@router.post("/v1/embeddings", responses=json_answer(EmbeddingList, "One embedding per input."))
async def embeddings(body: EmbeddingRequest, served: ModelsDep, tenant: AdmittedDep, settings: SettingsDep,
                     request: Request):
    generation = await served.get(body.model)
    size = generation.tokenizer.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise ApiError(400, f"dimensions is {body.dimensions}: this model's embeddings have {size} dimensions, "
                            "and it was not trained to be cut shorter (Matryoshka)", param="dimensions")
    vectors, tokens = await pooling.embed(generation, body.inputs(), tenant, body.priority, _caps(settings), request)
    data = [{"object": "embedding", "index": i,
             "embedding": vector if body.encoding_format == "base64" else pooling.floats(vector)}
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


def _caps(settings) -> pooling.Caps:
    return pooling.Caps(settings.max_pooling_inputs, settings.max_pooling_tokens)


for _path in RERANK_PATHS:
    router.add_api_route(_path, rerank, methods=["POST"], include_in_schema=_path == "/v1/rerank",
                         responses=json_answer(Rerank, "The documents, the most relevant first."))
