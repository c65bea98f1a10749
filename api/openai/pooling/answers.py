"""The pooling endpoints' answers as /openapi.json documents them (api/core/openapi.py):
OpenAI's embedding list, and the rerank results llama.cpp and vLLM answer."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer

MODEL = "SmolLM2-135M-Instruct"


class PoolingUsage(Answer):
    prompt_tokens: int
    total_tokens: int


class Embedding(Answer):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="The vector; base64 of little-endian float32 values with "
                                                     "encoding_format: base64.")


class EmbeddingList(Answer):
    """One embedding per input, in the inputs' order."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0123, -0.0456, 0.0789]}],
         "model": MODEL, "usage": {"prompt_tokens": 4, "total_tokens": 4}}]})

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: PoolingUsage


class RerankDocument(Answer):
    text: str


class RerankResult(Answer):
    index: int = Field(description="The document's place in the request.")
    relevance_score: float
    document: RerankDocument | None = Field(None, description="With return_documents (the default).")


class Rerank(Answer):
    """The documents by relevance to the query, the most relevant first (top_n of them)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "rerank-3c2d", "object": "list", "model": MODEL, "usage": {"prompt_tokens": 18, "total_tokens": 18},
         "results": [{"index": 1, "relevance_score": 0.93, "document": {"text": "Paris is the capital of France."}}]}]})

    id: str
    object: Literal["list"]
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class Score(Answer):
    index: int = Field(description="The pair's place in the request.")
    object: Literal["score"]
    score: float


class ScoreList(Answer):
    """One score per (text_1, text_2) pair, in order (vLLM's score API)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "score-3c2d", "object": "list", "created": 1767225600, "model": MODEL,
         "usage": {"prompt_tokens": 18, "total_tokens": 18}, "data": [{"index": 0, "object": "score", "score": 0.93}]}]})

    id: str
    object: Literal["list"]
    created: int
    model: str
    usage: PoolingUsage
    data: list[Score]
