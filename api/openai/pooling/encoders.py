"""Pooling requests for encoder models (shared/pooling_model.py): how an embedding model's inputs
and a cross-encoder's pairs are tokenized, as sentence-transformers tokenizes them.

- Embeddings: a named prompt (TEI's `prompt_name`, else the model's default prompt) goes before
  each text; a model whose Pooling leaves the prompt out is told how many tokens it took.
- Rerank and score on a cross-encoder: each pair framed as the tokenizer frames a pair
  ([CLS] query [SEP] document [SEP]); the query and its frame are queued once (PoolSpec head).
- Rerank and score on an embedding model: the cosine of the query's embedding (its "query"
  prompt, where the model has one) and each document's (its "document" prompt), as vLLM scores
  with an embedding model and sentence-transformers' encode_query / encode_document embed.
"""
from __future__ import annotations

import math

from api.core.errors import ApiError
from api.core.generation import Generation
from shared.messages import PoolSpec
from shared.pooling_model import PoolingModel


def model_of(generation: Generation) -> PoolingModel:
    model = generation.tokenizer.pooling
    assert model is not None, "an encoder's route"
    return model


def prompt_of(model: PoolingModel, name: str | None) -> str:
    try:
        return model.prompt(name)
    except KeyError:
        raise ApiError(400, f"prompt_name {name!r} is not one of this model's prompts "
                            f"({sorted(model.prompts) or 'it has none'})", param="prompt_name") from None


def prompt_skip(generation: Generation, prompt: str) -> int:
    """The prompt's tokens left out of an input's pooling (0 where the model pools them too)."""
    model = model_of(generation)
    return generation.tokenizer.prompt_length(_case(model, prompt)) if prompt and not model.include_prompt else 0


def encode_text(generation: Generation, prompt: str, text: str) -> list[int]:
    """One input's tokens, its prompt first, as sentence-transformers tokenizes it."""
    return generation.tokenizer.encode(_case(model_of(generation), prompt + text))


def pair_inputs(generation: Generation, query: str, documents: list[str]) -> tuple[list[int], list[list[int]]]:
    """A cross-encoder's pairs: the query framed (PoolSpec head) and each document with the tokens
    after it."""
    model, tok = model_of(generation), generation.tokenizer
    head, after = tok.pair_frame(_case(model, query), _case(model, documents[0]))
    return head, [tok.encode(_case(model, doc), add_special_tokens=False) + after for doc in documents]


def cosines(query: list[float], documents: list[list[float]]) -> list[float]:
    def norm(v: list[float]) -> float:
        return math.sqrt(sum(x * x for x in v)) or 1.0

    q = norm(query)
    return [sum(a * b for a, b in zip(query, doc)) / (q * norm(doc)) for doc in documents]


def check_task(generation: Generation, wanted: str, route: str) -> None:
    """400 where the encoder does not compute what the route asks for."""
    model = model_of(generation)
    if wanted == "embed" and model.kind == "classify":
        raise ApiError(400, f"{generation.model_name!r} is a cross-encoder: it scores pairs of texts on /v1/rerank "
                            f"and /v1/score, and gives no embeddings on {route}", param="model",
                       code="pooling_not_supported")


def spec_for_embed(ids: list[list[int]], skips: list[int]) -> PoolSpec:
    return PoolSpec(task="embed", lengths=[len(x) for x in ids], skips=skips if any(skips) else [])


def truncate(vector: list[float], dimensions: int) -> list[float]:
    """A Matryoshka embedding cut to its first `dimensions` values, scaled to length 1 again."""
    cut = vector[:dimensions]
    n = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / n for x in cut]


def _case(model: PoolingModel, text: str) -> str:
    return text.lower() if model.do_lower_case else text
