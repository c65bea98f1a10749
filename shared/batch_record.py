"""The batch record: the hash each offline batch has in Redis (shared/redis_keys.batch_record).

Its field names are said once, here (`BatchField`), as the request record's are in
shared/request_record.py: the api writes a new batch's fields (`BatchRecord.created`) and reads
the batch back for its owner (api/openai/batches.py); the scheduler's batch job marks it in
progress and completed and counts its results (scheduler/batches.py), its Lua script given the
count's field name as an argument, so it spells none itself. Each request of a batch is a
`BatchEntry`, one JSON string in the batch's list (shared/redis_keys.batch_items), written by the
api and read by the scheduler's job and the results route; each result a `BatchResult` line.

Read back, a record is one typed value (`BatchRecord.of`), with `fields()` the inverse: the hash
as Redis keeps it (numbers as redis-py writes them, repr of the int or float).
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, model_validator

from shared.messages import RequestPayload, Versioned


class BatchStatus(enum.StrEnum):
    """The statuses a batch record takes, in OpenAI's Batch API names (the batch object repeats them)."""

    VALIDATING = "validating"  # written by the api; the scheduler's job has not started it yet
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"  # every request ended, each counted completed or failed
    EXPIRED = "expired"  # its completion window passed first: the unfinished requests ended batch_expired

    @property
    def finished(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.EXPIRED)


# The completion windows a batch may ask for: 1h to 24h, whole hours (OpenAI takes 24h only).
WINDOW_PATTERN = r"^([1-9]|1[0-9]|2[0-4])h$"
DEFAULT_WINDOW = "24h"
# The error code of a request its batch's window ended before it finished, OpenAI's.
EXPIRED_CODE = "batch_expired"


def window_seconds(window: str) -> int:
    """Seconds of a completion window such as "24h" (one WINDOW_PATTERN matches)."""
    return int(window.removesuffix("h")) * 3600


class BatchField(enum.StrEnum):
    """The record's hash fields. The member names are the BatchRecord attributes."""

    STATUS = "status"
    ENDPOINT = "endpoint"  # the OpenAI endpoint every request of the batch is for
    # The tenant that created it ("" when auth is off). Stored as "owner", the name every batch was
    # written with before the code said `tenant`: renaming it in Redis would need a migration,
    # since a replica of the previous version reads it (and so does the request record's, likewise).
    TENANT = "owner"
    CREATED_AT = "created_at"  # whole seconds since the epoch
    TOTAL = "total"  # requests in the batch
    COMPLETED = "completed"  # requests that ended done (HINCRBY by the batch job)
    FAILED = "failed"  # requests that ended otherwise
    METADATA = "metadata"  # the caller's metadata, as JSON
    STARTED_AT = "started_at"  # when the scheduler's job began it (seconds since the epoch, a float)
    COMPLETED_AT = "completed_at"  # when its last request ended
    WINDOW = "completion_window"  # as asked, e.g. "24h" (absent on batches written before windows: 24h)
    EXPIRES_AT = "expires_at"  # created_at plus the window: the job ends what is unfinished then
    EXPIRED_AT = "expired_at"  # when the job ended it so
    INPUT_FILE_ID = "input_file_id"  # the Files API file its requests came from ("" when inline)
    OUTPUT_FILE_ID = "output_file_id"  # the file of its results with a response, once it ended
    ERROR_FILE_ID = "error_file_id"  # the file of its results with an error, once it ended


@dataclass(frozen=True)
class BatchRecord:
    """A batch's record as read from Redis; None stands for a field not written (yet)."""

    status: BatchStatus
    endpoint: str
    tenant: str = ""
    created_at: int = 0
    total: int = 0
    completed: int = 0
    failed: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: float | None = None
    completed_at: float | None = None
    window: str | None = None  # None: a batch written before windows, read as DEFAULT_WINDOW
    expires_at: int | None = None  # likewise: its created_at plus 24h
    expired_at: float | None = None
    input_file_id: str = ""
    output_file_id: str = ""
    error_file_id: str = ""

    @classmethod
    def created(cls, endpoint: str, tenant: str, created_at: int, total: int,
                metadata: dict[str, str] | None, window: str = DEFAULT_WINDOW, input_file_id: str = "") -> BatchRecord:
        """The record the api writes as it hands the batch to the scheduler."""
        return cls(status=BatchStatus.VALIDATING, endpoint=endpoint, tenant=tenant, created_at=created_at,
                   total=total, metadata=metadata or {}, window=window,
                   expires_at=created_at + window_seconds(window), input_file_id=input_file_id)

    @classmethod
    def of(cls, fields: dict[str, str]) -> BatchRecord | None:
        """The record from its hash (HGETALL); None where it has no status: no batch, or only the
        count a late result added after it expired."""
        if BatchField.STATUS not in fields:
            return None
        get = fields.get

        def stamp(name: BatchField) -> float | None:
            return float(get(name)) if get(name) else None
        expires_at = get(BatchField.EXPIRES_AT)
        return cls(
            status=BatchStatus(fields[BatchField.STATUS]), endpoint=get(BatchField.ENDPOINT, ""),
            tenant=get(BatchField.TENANT, ""), created_at=int(get(BatchField.CREATED_AT) or 0),
            total=int(get(BatchField.TOTAL) or 0), completed=int(get(BatchField.COMPLETED) or 0),
            failed=int(get(BatchField.FAILED) or 0), metadata=json.loads(get(BatchField.METADATA) or "{}"),
            started_at=stamp(BatchField.STARTED_AT), completed_at=stamp(BatchField.COMPLETED_AT),
            window=get(BatchField.WINDOW), expires_at=int(expires_at) if expires_at else None,
            expired_at=stamp(BatchField.EXPIRED_AT), input_file_id=get(BatchField.INPUT_FILE_ID, ""),
            output_file_id=get(BatchField.OUTPUT_FILE_ID, ""), error_file_id=get(BatchField.ERROR_FILE_ID, ""))

    @property
    def completion_window(self) -> str:
        return self.window or DEFAULT_WINDOW

    @property
    def deadline(self) -> int:
        """When the window ends (seconds since the epoch)."""
        return self.expires_at if self.expires_at is not None else \
            self.created_at + window_seconds(self.completion_window)

    def fields(self) -> dict[str, str]:
        """The hash as Redis keeps it: every field that is set (the counts even at 0, the tenant even
        when ""), numbers as redis-py writes them, the metadata as json.dumps writes it."""
        out = {BatchField.STATUS.value: self.status.value, BatchField.ENDPOINT.value: self.endpoint,
               BatchField.CREATED_AT.value: repr(self.created_at), BatchField.TOTAL.value: repr(self.total),
               BatchField.COMPLETED.value: repr(self.completed), BatchField.FAILED.value: repr(self.failed),
               BatchField.METADATA.value: json.dumps(self.metadata), BatchField.TENANT.value: self.tenant}
        if self.window is not None:
            out[BatchField.WINDOW.value] = self.window
        if self.expires_at is not None:
            out[BatchField.EXPIRES_AT.value] = repr(self.expires_at)
        for name, at in ((BatchField.STARTED_AT, self.started_at), (BatchField.COMPLETED_AT, self.completed_at),
                         (BatchField.EXPIRED_AT, self.expired_at)):
            if at is not None:
                out[name.value] = repr(at)
        for name, file_id in ((BatchField.INPUT_FILE_ID, self.input_file_id),
                              (BatchField.OUTPUT_FILE_ID, self.output_file_id),
                              (BatchField.ERROR_FILE_ID, self.error_file_id)):
            if file_id:
                out[name.value] = file_id
        return out


class BatchEntry(Versioned):
    """One request of a batch as the api checked it: the caller's id for it, the endpoint it is for,
    and the request ready to queue (its id is the result's request id). One JSON string in the
    batch's list; an entry written before entries had a version reads as version 1."""

    custom_id: str
    endpoint: str
    payload: RequestPayload


class ResultError(BaseModel):
    code: str  # the status the request ended in
    message: str


class ResultUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResultMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResultMessage
    logprobs: None = None
    finish_reason: str | None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class ResultBody(BaseModel):
    """The endpoint's answer, as the endpoint would have given it."""

    id: str
    object: Literal["chat.completion", "text_completion"]
    created: int
    model: str
    usage: ResultUsage
    choices: list[ChatChoice] | list[TextChoice]
    service_tier: Literal["flex"] = "flex"  # a batch's lines run in the flex tier (api/openai/batches.py)


class ResultResponse(BaseModel):
    status_code: int
    request_id: str
    body: ResultBody


class BatchResult(BaseModel):
    """One line of a batch's results, in OpenAI's batch output shape (its JSON keys are OpenAI's, so
    it carries no version of ours): written by the scheduler's batch job, served as it is by the api's
    results route. Either a response or an error."""

    id: str
    custom_id: str
    response: ResultResponse | None
    error: ResultError | None

    @model_validator(mode="after")
    def _response_or_error(self) -> BatchResult:
        if (self.response is None) == (self.error is None):
            raise ValueError("a batch result has a response or an error, not both nor neither")
        return self

    def encode(self) -> str:
        """The line as the results have always held it: json.dumps's spacing, non-ASCII as it is."""
        return json.dumps(self.model_dump(mode="json"), ensure_ascii=False)

    @classmethod
    def decode(cls, data: str | bytes) -> BatchResult:
        return cls.model_validate_json(data)
