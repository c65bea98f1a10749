"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes, per served model: a prompt (or chat
messages through the model's chat template, tools included) to its token ids, and token ids back to
text. Nothing is queued: the api does it in its tokenize pool, once the caller is admitted (a
tenant past its limits is refused before its text costs any CPU)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.core.auth import AdmittedDep
from api.core.chat import ChatMessage, ChatRequest
from api.core.deps import ModelsDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.core.tools import Tool
from api.openai.answers import OpenAIError
from shared.sampling import MAX_TOKEN_ID

router = APIRouter(tags=["tokenizer"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))
PATHS = ("/tokenize", "/detokenize")


class TokenizeRequest(BaseModel):
    """vLLM's two bodies in one: `prompt` (a completion's text), or `messages` (a chat, rendered by
    the model's chat template). The chat-only fields are refused beside a prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # A prompt gets the tokenizer's special tokens (a BOS); a chat's template writes its own.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # a chat: the assistant turn's opening after the messages (default true)
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.prompt is not None and (self.add_generation_prompt is not None or self.tools is not None
                                        or self.continue_final_message or self.chat_template_kwargs is not None):
            raise ValueError("add_generation_prompt, continue_final_message, tools and chat_template_kwargs go with "
                             "messages, not a prompt")
        if self.continue_final_message:
            raise ValueError("continue_final_message is not supported")
        return self


class TokenizeAnswer(BaseModel):
    count: int
    max_model_len: int  # the model's context: a prompt of more tokens is refused when run
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's piece of the vocabulary, where asked


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeAnswer(BaseModel):
    prompt: str  # the text, special tokens written out


@router.post("/tokenize", responses=json_answer(TokenizeAnswer, "The prompt's token ids."))
async def tokenize(body: TokenizeRequest, served: ModelsDep, tenant: AdmittedDep):
    generation = await served.get(body.model)
    if body.messages is None:
        ids = await generation.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        # As a chat completion of these messages and tools would run them (its prompt tokens).
        try:
            chat = ChatRequest(messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs)
        except ValidationError as exc:
            raise ApiError(400, "; ".join(e["msg"] for e in exc.errors()), param="tools") from exc
        prompt = chat.as_prompt(generation.tool_format)
        ids = await generation.encode(messages=prompt.messages, tools=prompt.tools, template_kwargs=prompt.template_kwargs,
                                      add_special_tokens=bool(body.add_special_tokens),
                                      add_generation_prompt=body.add_generation_prompt is not False)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": generation.tokenizer.context_length, "tokens": ids,
                              "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = generation.tokenizer.token_strs(ids)
    return answer


@router.post("/detokenize", responses=json_answer(DetokenizeAnswer, "The tokens' text."))
async def detokenize(body: DetokenizeRequest, served: ModelsDep, tenant: AdmittedDep):
    generation = await served.get(body.model)
    vocab = generation.tokenizer.vocab_size
    if (bad := next((t for t in body.tokens if not 0 <= t < min(vocab, MAX_TOKEN_ID + 1)), None)) is not None:
        raise ApiError(400, f"token id {bad} is not in this model's vocabulary (0 to {vocab - 1})", param="tokens")
    text = await generation.tokenize(generation.tokenizer.decode, body.tokens, False, param="tokens")
    return {"prompt": text}

