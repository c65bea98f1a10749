"""Request bodies of the pooling endpoints: /v1/embeddings (OpenAI's) and /v1/rerank (the shape
llama.cpp's server, vLLM, Jina and Cohere share). An unknown field is a 400 naming it; more inputs than
STREAMQ_MAX_POOLING_INPUTS is a 413 (api/openai/pooling/inputs.py Caps)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.messages import MAX_PRIORITY
from shared.sampling import TokenId

MAX_TEXT_CHARS = 1_000_000  # one input's characters; its tokens are checked against the context


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A string, a list of strings, a list of token ids, or a list of such lists (OpenAI's four forms)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Cut the embedding to its first n values, scaled to length "
                                                           "1 again: only for a model trained for it (Matryoshka); "
                                                           "else only the model's own size.")
    # Text Embeddings Inference's field: the model's named prompt put before each text
    # (config_sentence_transformers.json); without it, the model's default prompt, if any.
    prompt_name: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = Field(None, max_length=256)  # the caller's end user, for its own records: changes nothing
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("input")
    @classmethod
    def _inputs_in_bounds(cls, value):
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("input is empty: give a string, a list of strings, or token ids")
        if isinstance(items[0], int):
            items = [items]  # one input of token ids
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"input[{i}] is empty")
            if isinstance(item, str) and len(item) > MAX_TEXT_CHARS:
                raise ValueError(f"input[{i}] has {len(item)} characters; at most {MAX_TEXT_CHARS}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input, as text or as token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    documents: list[str | Document] = Field(min_length=1)  # how many: STREAMQ_MAX_POOLING_INPUTS (413 past it)
    model: str | None = None
    top_n: int | None = Field(None, ge=1, description="Return the n most relevant documents (all by default).")
    return_documents: bool = Field(True, description="Include each document's text in its result.")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("documents")
    @classmethod
    def _texts_not_empty(cls, value: list) -> list:
        for i, doc in enumerate(value):
            if isinstance(doc, str) and not doc:
                raise ValueError(f"documents[{i}] is empty")
            if isinstance(doc, str) and len(doc) > MAX_TEXT_CHARS:
                raise ValueError(f"documents[{i}] has {len(doc)} characters; at most {MAX_TEXT_CHARS}")
        return value

    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class ScoreRequest(BaseModel):
    """vLLM's /v1/score: text_1 scored against each text_2 (one text_1 for all, or one each)."""

    model_config = ConfigDict(extra="forbid")

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts_not_empty(cls, value: str | list[str]) -> str | list[str]:
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("give at least one text")
        for i, text in enumerate(items):
            if not text:
                raise ValueError(f"text {i} is empty")
            if len(text) > MAX_TEXT_CHARS:
                raise ValueError(f"text {i} has {len(text)} characters; at most {MAX_TEXT_CHARS}")
        return value

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) of each score, in order; a 400 where the lists' lengths do not pair up."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                             "or as many as text_2")
        return list(zip(first, second))
