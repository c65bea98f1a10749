"""The request record: the hash each request has in Redis (shared/redis_keys.request_record).

Its field names are said once, here (`RecordField`), and every reader and writer takes them from
here: the api writes a queued request's fields (`RequestRecord.queued`), a worker's claim and its
publisher add theirs as the request runs, and the Lua scripts that shared/store.py and
shared/requeue.py run (shared/lua/) change its status. A script gets the names as Lua tables made
here (`LUA_NAMES`: F for fields, S for statuses, R for finish reasons), put before it at load time
by shared/scripts.py with redis_keys.EVENT_FIELD, so no script spells a field, a status or a
finish reason itself.

Read back, a record is one typed value (`RequestRecord.of`), with `fields()` the inverse: the hash
as Redis keeps it (numbers as redis-py writes them, repr of the int or float).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dataclass_fields

from shared.messages import FinishReason, RequestPayload, RequestStatus


class RecordField(enum.StrEnum):
    """The record's hash fields. The member names are the RequestRecord attributes."""

    STATUS = "status"
    MODEL = "model"
    # The tenant that submitted it ("" when auth is off). Stored as "owner", the name every record
    # (and queue entry: RequestPayload.tenant) was written with before the code said `tenant`:
    # renaming it in Redis would need a migration, since a replica of the previous version reads it.
    TENANT = "owner"
    PARAMS = "params"  # the sampling parameters, as JSON
    PROMPT_TOKENS = "prompt_tokens"
    CREATED_AT = "created_at"  # seconds since the epoch, as every *_at field
    EXPIRES_AT = "expires_at"  # not started by then: it expires (absent: no queue timeout)
    WORKER = "worker"  # the worker that claimed it ("" once put back in the queue)
    STARTED_AT = "started_at"  # when a worker claimed it
    SCHEDULED_AT = "scheduled_at"  # when its first step began
    FIRST_TOKEN_AT = "first_token_at"
    FINISH_REASON = "finish_reason"
    COMPLETION_TOKENS = "completion_tokens"  # written at the end by the worker that ran it
    FINISHED_AT = "finished_at"
    TEXT = "text"  # the whole output, written at the end by the worker that ran it
    REUSED_TOKENS = "reused_tokens"  # prompt tokens whose KV came from a cache
    ERROR = "error"
    CANCEL_REQUESTED = "cancel_requested"  # "1": a cancel came while it ran (its worker stops it)
    ATTEMPTS = "attempts"  # workers that died running it
    REQUEUED_FROM = "requeued_from"  # the queue entry it was last put back from (shared/requeue.py)
    REQUEUE_OUTCOME = "requeue_outcome"  # what that put-back decided


def _lua_table(name: str, members: type[enum.Enum]) -> str:
    return f"local {name} = {{" + ", ".join(f"{m.name.lower()} = '{m.value}'" for m in members) + "}\n"


# Lua tables naming the record's fields (F.finished_at), statuses (S.queued) and finish reasons
# (R.error), made from the enums above: the head of every script that reads or writes a record.
LUA_NAMES = (_lua_table("F", RecordField) + _lua_table("S", RequestStatus) + _lua_table("R", FinishReason))


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def _int(value: str | None) -> int | None:
    return int(value) if value else None


@dataclass(frozen=True)
class RequestRecord:
    """A request's record as read from Redis; None stands for a field not written (yet)."""

    status: RequestStatus
    model: str | None = None
    tenant: str = ""
    params: str | None = None
    prompt_tokens: int = 0
    created_at: float | None = None
    expires_at: float | None = None
    worker: str | None = None
    started_at: float | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    completion_tokens: int | None = None
    finished_at: float | None = None
    text: str | None = None
    reused_tokens: int | None = None
    error: str | None = None
    cancel_requested: bool = False
    attempts: int = 0
    requeued_from: str | None = None
    requeue_outcome: str | None = None

    @classmethod
    def queued(cls, payload: RequestPayload) -> RequestRecord:
        """The record the api writes as it queues the request."""
        return cls(status=RequestStatus.QUEUED, model=payload.model, tenant=payload.tenant,
                   params=payload.params.model_dump_json(), prompt_tokens=payload.num_prompt_tokens,
                   created_at=payload.created_at, expires_at=payload.expires_at or None)

    @classmethod
    def of(cls, fields: dict[str, str]) -> RequestRecord | None:
        """The record from its hash (HGETALL); None where it has no status: no record, or only what a
        late write left after it expired or was deleted."""
        if RecordField.STATUS not in fields:
            return None
        get = fields.get
        reason = get(RecordField.FINISH_REASON)
        return cls(
            status=RequestStatus(fields[RecordField.STATUS]), model=get(RecordField.MODEL),
            tenant=get(RecordField.TENANT, ""), params=get(RecordField.PARAMS),
            prompt_tokens=_int(get(RecordField.PROMPT_TOKENS)) or 0,
            created_at=_float(get(RecordField.CREATED_AT)), expires_at=_float(get(RecordField.EXPIRES_AT)),
            worker=get(RecordField.WORKER), started_at=_float(get(RecordField.STARTED_AT)),
            scheduled_at=_float(get(RecordField.SCHEDULED_AT)), first_token_at=_float(get(RecordField.FIRST_TOKEN_AT)),
            finish_reason=FinishReason(reason) if reason else None,
            completion_tokens=_int(get(RecordField.COMPLETION_TOKENS)), finished_at=_float(get(RecordField.FINISHED_AT)),
            text=get(RecordField.TEXT), reused_tokens=_int(get(RecordField.REUSED_TOKENS)), error=get(RecordField.ERROR),
            cancel_requested=get(RecordField.CANCEL_REQUESTED) == "1", attempts=_int(get(RecordField.ATTEMPTS)) or 0,
            requeued_from=get(RecordField.REQUEUED_FROM), requeue_outcome=get(RecordField.REQUEUE_OUTCOME))

    def fields(self) -> dict[str, str]:
        """The hash as Redis keeps it: every field that is set, numbers as redis-py writes them."""
        out: dict[str, str] = {}
        for f in dataclass_fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name in _UNSET_WHEN_ZERO and not value):
                continue
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, bool):
                value = "1"
            elif isinstance(value, (int, float)):
                value = repr(value)
            out[RecordField[f.name.upper()].value] = value
        return out


# Fields never written until they become true or count something; the api writes the tenant always.
_UNSET_WHEN_ZERO = frozenset({"cancel_requested", "attempts"})
