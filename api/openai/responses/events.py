"""A stored response's events, made from its request's events in order (ResponseEvents): the
same on every replica, after any failover, so a client resumes a stream `starting_after` any
sequence number anywhere. Replies are read through the output parsers (api/core/parsers/)."""
from __future__ import annotations

import json
from typing import Any

from api.core.parsers import reasoning, registry
from api.core.parsers.base import CallDelta, Delta
from api.core.parsers.reply import ReplyParser
from api.openai.responses.record import LIVE_STATUS, ResponseRecord
from api.openai.responses.schemas import InputItem, load_items
from shared.messages import FinalEvent, FinishReason, TokenEvent

# Its final status by the request's finish reason.
FINAL_STATUS = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete",
                FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "failed", FinishReason.EXPIRED: "failed"}
# The event that ends a stream, by final status (a cancelled stream ends after closing its items).
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


class ResponseEvents:
    """The events of one response, numbered from 0, made from its request's events in order:
    `start` once, `token` for each token, `final` at the end; `response` is the response object
    as it stands. Text streams token by token; in a tool format, each function call streams as
    the model writes it (api/core/parsers/tool_stream.py: its item once the name is whole, then its arguments'
    pieces), and the rest of the reply is read whole at the end (an answer becomes a message).
    Every id is made from the response's, so a replay makes exactly the same events."""

    def __init__(self, record: ResponseRecord):
        self.record = record
        self.stem = record.id.removeprefix("resp_")
        self.sequence = 0
        self.status = "queued"
        self.output: list[dict[str, Any]] = []
        self.text: list[str] = []  # the message's text
        self.reply = ReplyParser(None if record.tools == "none" else registry.get(record.tools),
                                 reasoning.named(record.reasoning))
        self.thought: dict[str, Any] | None = None  # the reasoning item being streamed
        self.message: dict[str, Any] | None = None  # the message item being streamed
        self.call: dict[str, Any] | None = None  # the function call item being streamed
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: int | None = None

    @property
    def live(self) -> bool:
        """Queued or in progress: not ended yet."""
        return self.status in LIVE_STATUS.values()

    def response(self) -> dict[str, Any]:
        r = self.record
        return {"id": r.id, "object": "response", "created_at": r.created_at, "model": r.model, **r.echo,
                "status": self.status, "output": json.loads(json.dumps(self.output)), "usage": self.usage,
                "error": self.error, "incomplete_details": self.incomplete, "completed_at": self.completed_at}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        created = self._event("response.created", response=self.response())
        self.status = "in_progress"
        return [created, self._event("response.in_progress", response=self.response())]

    def token(self, token: TokenEvent) -> list[dict[str, Any]]:
        # Fed even without text (a character still partial): it is one of the thought's tokens, or not.
        return self._deltas(self.reply.feed(token.text))

    def _deltas(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.reasoning:
                out += self._thought_delta(delta.reasoning)
                continue
            if self.thought is not None and (delta.call is not None or delta.content):
                out += self._close_thought("completed")  # the answer begins: the thought is whole
            if delta.call is not None:
                out += self._call_delta(delta.call)
            elif delta.content:
                out += self._open_message()
                self.text.append(delta.content)
                out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                       output_index=self.output.index(self.message), content_index=0,
                                       delta=delta.content, logprobs=[]))
        return out

    def _thought_delta(self, text: str) -> list[dict[str, Any]]:
        """A piece of the thought: its reasoning item first (at its first piece), then the piece."""
        out = []
        if self.thought is None:
            self.thought = {"id": f"rs_{self.stem}", "type": "reasoning", "status": "in_progress", "summary": [],
                            "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self.thought)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=json.loads(json.dumps(self.thought))))
        self.thought["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                               output_index=self.output.index(self.thought), content_index=0, delta=text))
        return out

    def _close_thought(self, status: str) -> list[dict[str, Any]]:
        item, self.thought = self.thought, None
        item["status"] = status
        index = self.output.index(item)
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        self.message = {"id": f"msg_{self.stem}", "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        self.output.append(self.message)
        index = len(self.output) - 1
        added = self._event("response.output_item.added", output_index=index, item=json.loads(json.dumps(self.message)))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                   content_index=0, part=dict(part))]

    def final(self, final: FinalEvent, completed_at: int | None) -> list[dict[str, Any]]:
        status = FINAL_STATUS[final.finish_reason]
        out: list[dict[str, Any]] = self._deltas(self.reply.flush())  # what the reasoning stage kept back
        if self.thought is not None:  # a thought the reply never left
            out += self._close_thought("completed" if status == "completed" else "incomplete")
        if self.reply.holding:
            reply = self.reply.finish(final.finish_reason.value)
            content, calls = reply.content, reply.tool_calls
            if self.call is not None:  # cut by max_output_tokens: as far as it got
                out += self._close_call("incomplete")
            if content and not self.reply.calls:  # a held answer: the message's text is the answer's
                out += self._open_message()
                self.text = [content]
                out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                       output_index=self.output.index(self.message), content_index=0,
                                       delta=content, logprobs=[]))
            for i, call in enumerate(calls[self.reply.calls:], start=self.reply.calls):  # none streamed: whole
                out += self._function_call(i, call["function"]["name"], call["function"]["arguments"])
        elif status in ("completed", "incomplete") and not any(i["type"] == "reasoning" for i in self.output):
            out += self._open_message()  # an empty answer is an empty message (a thought alone is no answer)
        if self.message is not None:
            out += self._close_message("incomplete" if status != "completed" else "completed")
        self.status = status
        self.usage = _usage(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens,
                            self.reply.thought_tokens)
        if status == "incomplete":
            self.incomplete = {"reason": "max_output_tokens"}
        if status == "failed":
            self.error = {"code": "server_error", "message": final.error or f"the request {final.status.value}"}
        self.completed_at = completed_at if status == "completed" else None
        if status in TERMINAL:
            out.append(self._event(TERMINAL[status], response=self.response()))
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, index = self.message, self.output.index(self.message)
        text = "".join(self.text)
        message["content"][0]["text"] = text
        message["status"] = status
        part = dict(message["content"][0])
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(message)))]

    def _call_delta(self, call: CallDelta) -> list[dict[str, Any]]:
        """A streamed call's events: its item at its name, its arguments' pieces, done at its close."""
        out: list[dict[str, Any]] = []
        if call.name is not None:
            self.call = {"id": f"fc_{self.stem}_{call.index}", "type": "function_call", "status": "in_progress",
                         "call_id": f"call_{self.stem[:24]}_{call.index}", "name": call.name, "arguments": ""}
            self.output.append(self.call)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(self.call)))
        if call.arguments:
            self.call["arguments"] += call.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                   output_index=self.output.index(self.call), delta=call.arguments))
        if call.closed:
            out += self._close_call("completed")
        return out

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        item, self.call = self.call, None
        item["status"] = status
        index = self.output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _function_call(self, i: int, name: str, arguments: str) -> list[dict[str, Any]]:
        """A call read whole at the end: the streamed call's events, in one go."""
        return self._call_delta(CallDelta(i, "", name=name)) + self._call_delta(CallDelta(i, arguments, closed=True))

    def output_items(self) -> list[InputItem]:
        """The response's output as input items of a later turn."""
        return load_items(json.dumps([{k: v for k, v in item.items() if k != "status"} | {"status": "completed"}
                                      for item in self.output]))


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


