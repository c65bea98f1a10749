"""The files of the Files API (/v1/files), kept in Redis: a tenant's uploads (a batch's input) and
the output and error files the scheduler's batch job writes.

Each file is one hash (shared/redis_keys.file_record) holding its metadata and its bytes, with a
TTL from its creation, so nothing outlives `files_ttl_s`; a tenant's ids are a sorted set by
creation time (redis_keys.tenant_files), pruned of expired ids as it is read. A file is its
tenant's only: another tenant is told there is no such file. A batch's files are UTF-8 text (JSON
lines), kept as they are; an image (purpose vision or user_data) is kept base64-encoded, since the
clients read Redis with decode_responses.
"""
from __future__ import annotations

import base64
import enum
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from shared import redis_keys


class FileField(enum.StrEnum):
    """The file hash's fields."""

    TENANT = "tenant"  # "" when auth is off
    FILENAME = "filename"
    PURPOSE = "purpose"  # batch (an upload), batch_output (a batch's results and errors)
    BYTES = "bytes"
    CREATED_AT = "created_at"  # whole seconds since the epoch
    EXPIRES_AT = "expires_at"  # likewise: when Redis frees it
    CONTENT = "content"


BINARY_PURPOSES = ("vision", "user_data")  # images, for Responses' input_image file_id: kept base64-encoded


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StoredFile:
    """A file's metadata, in the shape of OpenAI's file object (`as_object`)."""

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int

    def as_object(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}

    @classmethod
    def of(cls, file_id: str, fields: dict[str, str]) -> StoredFile | None:
        if FileField.PURPOSE not in fields:
            return None
        return cls(id=file_id, tenant=fields.get(FileField.TENANT, ""), filename=fields.get(FileField.FILENAME, ""),
                   purpose=fields[FileField.PURPOSE], bytes=int(fields.get(FileField.BYTES) or 0),
                   created_at=int(fields.get(FileField.CREATED_AT) or 0),
                   expires_at=int(fields.get(FileField.EXPIRES_AT) or 0))


class FileStore:
    """Files of one key prefix; every read is on behalf of a tenant and sees only its files."""

    def __init__(self, redis: Redis, prefix: str, ttl_s: int):
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    async def create(self, tenant: str, filename: str, purpose: str, content: bytes,
                     file_id: str | None = None) -> StoredFile:
        """Store a file (under `file_id` when given: a job run again writes the same file anew)."""
        created = int(time.time())
        stored = StoredFile(id=file_id or new_file_id(), tenant=tenant, filename=filename, purpose=purpose,
                            bytes=len(content), created_at=created, expires_at=created + self.ttl_s)
        key = redis_keys.file_record(self.prefix, stored.id)
        index = redis_keys.tenant_files(self.prefix, tenant)
        # The file before its index entry (two slots, no MULTI on a cluster): a listed id always has a file.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={FileField.TENANT: tenant, FileField.FILENAME: filename, FileField.PURPOSE: purpose,
                                    FileField.BYTES: stored.bytes, FileField.CREATED_AT: created,
                                    FileField.EXPIRES_AT: stored.expires_at,
                                    FileField.CONTENT: base64.b64encode(content).decode() if purpose in BINARY_PURPOSES
                                    else content})
            pipe.expire(key, self.ttl_s)
            pipe.zadd(index, {stored.id: created})
            pipe.expire(index, self.ttl_s)  # the newest file's lifetime: an index outlives none of its files
            await pipe.execute()
        return stored

    async def get(self, tenant: str, file_id: str) -> StoredFile | None:
        """The file's metadata; None where there is none, or it is another tenant's."""
        fields = await self.redis.hgetall(redis_keys.file_record(self.prefix, file_id))
        stored = StoredFile.of(file_id, fields)
        return stored if stored is not None and stored.tenant == tenant else None

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        """The file's bytes; None where there is no such file of this tenant."""
        key = redis_keys.file_record(self.prefix, file_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(key, FileField.TENANT)
            pipe.hget(key, FileField.PURPOSE)
            pipe.hget(key, FileField.CONTENT)
            owner, purpose, content = await pipe.execute()
        if owner is None or owner != tenant or content is None:
            return None
        if purpose in BINARY_PURPOSES:
            return base64.b64decode(content)
        return content.encode("utf-8") if isinstance(content, str) else content

    async def list(self, tenant: str, limit: int = 10_000) -> list[StoredFile]:
        """The tenant's files, newest first; ids whose file has expired are dropped from the index."""
        index = redis_keys.tenant_files(self.prefix, tenant)
        ids = await self.redis.zrevrange(index, 0, limit - 1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hmget(redis_keys.file_record(self.prefix, file_id),
                           [FileField.TENANT, FileField.FILENAME, FileField.PURPOSE, FileField.BYTES,
                            FileField.CREATED_AT, FileField.EXPIRES_AT])
            rows = await pipe.execute()
        names = [FileField.TENANT, FileField.FILENAME, FileField.PURPOSE, FileField.BYTES, FileField.CREATED_AT,
                 FileField.EXPIRES_AT]
        files, gone = [], []
        for file_id, row in zip(ids, rows, strict=True):
            stored = StoredFile.of(file_id, {n.value: v for n, v in zip(names, row, strict=True) if v is not None})
            (files if stored is not None else gone).append(stored or file_id)
        if gone:
            await self.redis.zrem(index, *gone)
        return files

    async def delete(self, tenant: str, file_id: str) -> bool:
        """Delete the tenant's file; False where it has no such file."""
        if await self.get(tenant, file_id) is None:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(redis_keys.file_record(self.prefix, file_id))
            pipe.zrem(redis_keys.tenant_files(self.prefix, tenant), file_id)
            await pipe.execute()
        return True
