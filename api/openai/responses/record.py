"""What is stored of a Responses API response (ResponseRecord), fixed when it is created: the
request's settings as the response object repeats them, its input items, the conversation it
continues (for a later `previous_response_id`), its tool and reasoning formats."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from api.openai.responses.schemas import InputItem, dump_items, load_items
from shared.messages import RequestStatus

# The response object's status while the request waits for a worker, and while it runs.
LIVE_STATUS = {RequestStatus.QUEUED: "queued", RequestStatus.RUNNING: "in_progress"}


@dataclass
class ResponseRecord:
    """What is stored of a response: fixed when it is created."""
    id: str
    tenant: str
    request_id: str
    model: str
    created_at: int
    echo: dict[str, Any]  # the request's settings, as the response object repeats them
    input_items: list[InputItem]  # this response's input, with ids
    context: list[InputItem]  # the conversation it ran on: earlier turns, then its input
    tools: str  # the reply's tool format: "none", "generic" or "hermes"
    prompt_tokens: int
    reasoning: str = "none"  # the reply's reasoning format (ThinkFormat.key), "none" where it has none

    def fields(self) -> dict[str, str]:
        return {"request_id": self.request_id, "model": self.model, "created_at": str(self.created_at),
                "echo": json.dumps(self.echo, ensure_ascii=False), "input_items": dump_items(self.input_items),
                "context": dump_items(self.context), "tools": self.tools, "prompt_tokens": str(self.prompt_tokens),
                "reasoning": self.reasoning}

    @classmethod
    def of(cls, response_id: str, tenant: str, fields: dict[str, str]) -> ResponseRecord:
        return cls(id=response_id, tenant=tenant, request_id=fields["request_id"], model=fields["model"],
                   created_at=int(fields["created_at"]), echo=json.loads(fields["echo"]),
                   input_items=load_items(fields["input_items"]), context=load_items(fields["context"]),
                   tools=fields["tools"], prompt_tokens=int(fields["prompt_tokens"]),
                   reasoning=fields.get("reasoning", "none"))


def with_ids(response_id: str, items: list[InputItem]) -> list[InputItem]:
    """The input items, each with an id (its own, or one made from the response's) and a status."""
    stem = response_id.removeprefix("resp_")
    kinds = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [item.model_copy(update={"id": item.id or f"{kinds[item.type]}_{stem}_in{i}",
                                    "status": item.status or "completed"})
            for i, item in enumerate(items)]


def whole_seconds(value: float | None) -> int | None:
    """A record's time field in whole seconds; None where unset."""
    return int(value) if value else None



def now_s() -> int:
    return int(time.time())
