"""OpenAI's answers as /openapi.json documents them (api/core/openapi.py): models, completions,
chat completions, batches and the error body. The Responses API's are in responses/answers.py,
the pooling endpoints' in pooling/answers.py."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer

MODEL = "SmolLM2-135M-Instruct"
USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="The model's context (a base model served here).")
    parent: str | None = Field(None, description="An adapter's base model.")


class ModelList(Answer):
    """The models with a live worker, then the LoRA adapters the caller may use."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "streamq", "max_model_len": 8192}]}]})

    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(Answer):
    cached_tokens: int = Field(description="Prompt tokens a worker took from a cache (prefix cache, KV tier).")


class CompletionTokensDetails(Answer):
    reasoning_tokens: int = Field(description="Of the completion's tokens, those of the thought (a thinking model's).")


class CompletionUsage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="Chat completions of a model that thinks aloud (a reasoning parser on).")


class CompletionLogprobs(Answer):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="With echo, the first prompt token's is null.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(Answer):
    logprob: float
    rank: int
    decoded_token: str


FinishReason = Literal["stop", "length", "tool_calls", "abort"] | None  # abort: cancelled (vLLM's word)


class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = Field(
        None, description="With prompt_logprobs (vLLM's): null for the first prompt token, then each token id's "
                          "entry: the token itself and the likeliest there.")


class Completion(Answer):
    """A text completion; with `stream: true`, chunks of this shape (`usage` last, with include_usage)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "cmpl-2f0c", "object": "text_completion", "created": 1767225600, "model": MODEL,
         "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "stop"}], "usage": USAGE,
         "service_tier": "default"}]})

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    service_tier: Literal["priority", "default", "flex"] = Field(description="The service tier that served it.")


class FunctionCall(Answer):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object's text.")


class ToolCall(Answer):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # A model that thinks aloud (a reasoning parser, STREAMQ_REASONING_PARSER): its thought, apart
    # from content; `reasoning` is vLLM's newer name for the same text
    reasoning_content: str | None = None
    reasoning: str | None = None


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[TokenLogprob]


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Answer):
    """A chat completion: each sample's message (its answer, or its tool calls) and the usage."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "chatcmpl-9a1b", "object": "chat.completion", "created": 1767225600, "model": MODEL,
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "logprobs": None,
                      "finish_reason": "stop"}], "usage": USAGE,
         "service_tier": "default"}]})

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    service_tier: Literal["priority", "default", "flex"] = Field(description="The service tier that served it.")


COMPLETION_EVENTS = ("`data:` chunks of the completion (`choices[].text` the new text), the last with its "
                     "finish_reason; with stream_options.include_usage a last chunk with `usage`; then `data: [DONE]`.")
COMPLETION_EVENTS_EXAMPLE = (
    'data: {"id": "cmpl-2f0c", "object": "text_completion", "created": 1767225600, "model": "' + MODEL + '", '
    '"choices": [{"index": 0, "text": " Paris", "logprobs": null, "finish_reason": null}]}\n\ndata: [DONE]\n\n')
CHAT_EVENTS = ("`data:` chat.completion.chunk objects: the role first, then a thinking model's "
               "`delta.reasoning_content` (and `delta.reasoning`), then `delta.content` (or "
               "`delta.tool_calls` pieces), then the finish_reason; then `data: [DONE]`.")
CHAT_EVENTS_EXAMPLE = (
    'data: {"id": "chatcmpl-9a1b", "object": "chat.completion.chunk", "created": 1767225600, "model": "' + MODEL
    + '", "choices": [{"index": 0, "delta": {"content": "Paris"}, "logprobs": null, "finish_reason": null}]}\n\n'
    'data: [DONE]\n\n')


class RequestCounts(Answer):
    total: int
    completed: int
    failed: int


class Batch(Answer):
    """An offline batch: its status and progress; its results in its output and error files once it
    ended (and at `results_url` as one list)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "batch_5e1f", "object": "batch", "endpoint": "/v1/chat/completions", "status": "in_progress",
         "input_file_id": "file-0c8e4f3a9b2d4e6f8a1b3c5d7e9f0a2b", "completion_window": "24h",
         "created_at": 1767225600, "in_progress_at": 1767225601, "expires_at": 1767312000, "completed_at": None,
         "expired_at": None, "output_file_id": None, "error_file_id": None, "errors": None,
         "request_counts": {"total": 2, "completed": 1, "failed": 0}, "metadata": None,
         "results_url": "/v1/batches/batch_5e1f/results"}]})

    id: str
    object: Literal["batch"]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    status: Literal["validating", "in_progress", "completed", "expired"]
    input_file_id: str | None = Field(description="The file its requests came from (None: sent inline).")
    completion_window: str = Field(description="As asked: 1h to 24h.")
    created_at: int | None
    in_progress_at: int | None
    expires_at: int | None = Field(description="When the window ends: what is unfinished then fails batch_expired.")
    completed_at: int | None
    expired_at: int | None
    output_file_id: str | None = Field(description="Once ended: the file of the requests that got a response.")
    error_file_id: str | None = Field(description="Once ended: the file of the requests that failed or expired.")
    errors: None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    results_url: str


class FileObject(Answer):
    """A file of the Files API: a batch's input (purpose batch) or a batch's results (batch_output)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "file-0c8e4f3a9b2d4e6f8a1b3c5d7e9f0a2b", "object": "file", "bytes": 1024, "created_at": 1767225600,
         "expires_at": 1769817600, "filename": "requests.jsonl", "purpose": "batch", "status": "processed",
         "status_details": None}]})

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None


class FileList(Answer):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(Answer):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


class BatchResponse(Answer):
    status_code: int
    request_id: str
    body: dict[str, Any] = Field(description="The chat completion or completion, as the endpoint answers it.")


class BatchError(Answer):
    code: str = Field(description="How the request ended (failed, expired, cancelled).")
    message: str


class BatchResultLine(Answer):
    """One line of a batch's results (application/jsonl): a request's answer, or its error."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "batch_req_0b7c", "custom_id": "q1", "error": None, "response": {
            "status_code": 200, "request_id": "0b7c", "body": {"object": "chat.completion", "...": "..."}}}]})

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None


class ErrorDetail(Answer):
    message: str
    type: Literal["invalid_request_error", "rate_limit_error", "overloaded_error", "server_error"]
    param: str | None
    code: str | None


class OpenAIError(Answer):
    """OpenAI's error body: every error of the OpenAI paths (an invalid request is a 400)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"error": {
        "message": "temperature: Input should be less than or equal to 2", "type": "invalid_request_error",
        "param": "temperature", "code": None}}]})

    error: ErrorDetail
