"""The Responses API's answers as /openapi.json documents them (api/core/openapi.py): the response
object (api/openai/responses/events.py makes it), a deleted response, a page of input items."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer
from api.openai.responses.schemas import FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem

RESP = "resp_6f1c0e9b"
USAGE = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
MESSAGE = {"id": "msg_6f1c0e9b", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}]}


class OutputText(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(Answer):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object's text.")


class ReasoningTextPart(Answer):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(Answer):
    """A thinking model's thought (STREAMQ_REASONING_PARSER), before its answer."""

    id: str
    type: Literal["reasoning"]
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]
    content: list[ReasoningTextPart]


class InputTokensDetails(Answer):
    cached_tokens: int


class OutputTokensDetails(Answer):
    reasoning_tokens: int


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Answer):
    code: str
    message: str


class IncompleteDetails(Answer):
    reason: Literal["max_output_tokens"]


class ResponseObject(Answer):
    """A response as it stands: the request's settings repeated, its status, output and usage."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": RESP, "object": "response", "created_at": 1767225600, "model": "SmolLM2-135M-Instruct",
         "instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
         "previous_response_id": None, "store": True, "background": False, "temperature": 1.0, "top_p": 1.0,
         "truncation": "disabled", "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
         "status": "completed", "output": [MESSAGE], "usage": USAGE, "error": None, "incomplete_details": None,
         "completed_at": 1767225601, "service_tier": "default"}]})

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    background: bool
    temperature: float
    top_p: float
    truncation: Literal["disabled"]
    text: dict[str, Any] = Field(description="`{\"format\": ...}` as the request gave it.")
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    completed_at: int | None
    service_tier: Literal["priority", "default", "flex"] = Field(description="The service tier that serves it.")


class ResponseDeleted(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [{"id": RESP, "object": "response", "deleted": True}]})

    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(Answer):
    """A page of a response's input items (messages, function calls and their outputs)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"object": "list", "data": [
        {"id": "msg_6f1c0e9b_in0", "status": "completed", "type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "The capital of France?"}]}],
        "first_id": "msg_6f1c0e9b_in0", "last_id": "msg_6f1c0e9b_in0", "has_more": False}]})

    object: Literal["list"]
    data: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem] = Field(
        description="Input items as the request wrote them, each with an id and a status.")
    first_id: str | None
    last_id: str | None
    has_more: bool


RESPONSE_EVENTS = ("Named events (`event:` is the type), each with its `sequence_number`: response.created, "
                   "response.in_progress, response.output_item.added, a thinking model's "
                   "response.reasoning_text.delta ... .done, response.output_text.delta, ..., "
                   "response.completed (or .incomplete, .failed).")
RESPONSE_EVENTS_EXAMPLE = (
    'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "sequence_number": 4, '
    '"item_id": "msg_6f1c0e9b", "output_index": 0, "content_index": 0, "delta": "Paris", "logprobs": []}\n\n')
