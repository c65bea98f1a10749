"""OpenAI's Files API, for batches and images: a tenant uploads a batch's requests as a JSON-lines
file (`purpose=batch`), creates the batch from it (`input_file_id`), and reads the batch's output and
error files back; or uploads an image (`purpose=vision` or `user_data`, checked as a request's image
is: api/core/images.py) that a Responses `input_image` names by `file_id`. Files live in Redis (shared/files.py) with a lifetime (STREAMQ_FILES_TTL_S),
each one its tenant's only: another tenant is told there is no such file (404), as for batches.

Caps: one file's bytes (STREAMQ_FILES_MAX_BYTES, 413 past it) and the bytes a tenant keeps at
once (STREAMQ_FILES_TENANT_MAX_BYTES, 413 past it), so files cannot fill Redis for everyone.
"""
from __future__ import annotations

import asyncio
import re
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response

from api.core.auth import TenantDep
from api.core.deps import SettingsDep, StoreDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import FileDeleted, FileList, FileObject, OpenAIError
from api.core import images
from shared.files import BINARY_PURPOSES, FileStore, StoredFile

router = APIRouter(tags=["files"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))

# The server's own form of a file id (shared/files.new_file_id, the batch job's batch_file_id):
# any other spelling is no file of anyone's, answered 404 without a Redis read.
FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
# The purposes a file may be uploaded with: batch inputs, and images (a batch's results are written
# by the server, purpose batch_output).
UPLOAD_PURPOSES = ("batch", *BINARY_PURPOSES)


def file_store(store: StoreDep, settings: SettingsDep) -> FileStore:
    return FileStore(store.redis, store.prefix, settings.files_ttl_s)


async def owned(files: FileStore, tenant: str, file_id: str, param: str = "file_id") -> StoredFile:
    """The tenant's file `file_id`; 404 (on `param`) for an id not in the server's form, no such file,
    or another tenant's."""
    stored = await files.get(tenant, file_id) if FILE_ID.match(file_id) else None
    if stored is None:
        raise ApiError(404, f"no file {file_id!r}", param=param, code="not_found")
    return stored


async def owned_content(files: FileStore, tenant: str, file_id: str, param: str = "file_id") -> bytes:
    """The bytes of the tenant's file `file_id`, in one read; 404 (on `param`) as `owned` answers."""
    content = await files.content(tenant, file_id) if FILE_ID.match(file_id) else None
    if content is None:
        raise ApiError(404, f"no file {file_id!r}", param=param, code="not_found")
    return content


@router.post("/v1/files", responses=json_answer(FileObject, "The file, stored."))
async def upload_file(file: Annotated[UploadFile, File(description="The file: JSON lines, UTF-8; or an image.")],
                      purpose: Annotated[str, Form(description="What the file is for: `batch`, or `vision` "
                                                               "or `user_data` (an image).")],
                      tenant: TenantDep, store: StoreDep, settings: SettingsDep):
    """Store a batch's input file (JSON lines, one request per line) for `POST /v1/batches`, or an
    image for a Responses `input_image` (`file_id`)."""
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"purpose {purpose!r} is not supported here; files are uploaded for: "
                            f"{', '.join(UPLOAD_PURPOSES)}", param="purpose")
    content = await file.read(settings.files_max_bytes + 1)
    if len(content) > settings.files_max_bytes:
        raise ApiError(413, f"the file is over the limit of {settings.files_max_bytes} bytes "
                            "(STREAMQ_FILES_MAX_BYTES)", param="file", code="file_too_large")
    if not content:
        raise ApiError(400, "the file is empty", param="file")
    if purpose in BINARY_PURPOSES:  # an image: checked now, as a request's image is (a 4xx naming why)
        await asyncio.to_thread(images.check, content, "file", images.Limits.of(settings), "file")
    else:
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"the file is not UTF-8 text (byte {exc.start}); a batch file is JSON lines",
                           param="file") from exc
    files = file_store(store, settings)
    kept = sum(f.bytes for f in await files.list(tenant))
    if kept + len(content) > settings.files_tenant_max_bytes:
        raise ApiError(413, f"this tenant's files would take {kept + len(content)} bytes, over the limit of "
                            f"{settings.files_tenant_max_bytes} (STREAMQ_FILES_TENANT_MAX_BYTES); delete some first",
                       param="file", code="file_too_large")
    name = (file.filename or "upload.jsonl")[:256]
    stored = await files.create(tenant, name, purpose, content)
    return stored.as_object()


@router.get("/v1/files", responses=json_answer(FileList, "The tenant's files."))
async def list_files(tenant: TenantDep, store: StoreDep, settings: SettingsDep,
                     purpose: Annotated[str | None, Query(max_length=64)] = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     order: Annotated[Literal["asc", "desc"], Query()] = "desc",
                     after: Annotated[str | None, Query(max_length=128)] = None):
    """The tenant's files (newest first unless `order=asc`), `limit` at a time after the id `after`."""
    found = await file_store(store, settings).list(tenant)
    if order == "asc":
        found.reverse()
    if purpose is not None:
        found = [f for f in found if f.purpose == purpose]
    if after is not None:
        ids = [f.id for f in found]
        if after not in ids:
            raise ApiError(400, f"after: no file {after!r} in this list", param="after")
        found = found[ids.index(after) + 1:]
    page = found[:limit]
    return {"object": "list", "data": [f.as_object() for f in page], "has_more": len(found) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


@router.get("/v1/files/{file_id}", responses=json_answer(FileObject, "The file's metadata."))
async def get_file(file_id: str, tenant: TenantDep, store: StoreDep, settings: SettingsDep):
    return (await owned(file_store(store, settings), tenant, file_id)).as_object()


@router.get("/v1/files/{file_id}/content", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                "format": "binary"}}},
                             "description": "The file's bytes."}})
async def file_content(file_id: str, tenant: TenantDep, store: StoreDep, settings: SettingsDep):
    files = file_store(store, settings)
    stored = await owned(files, tenant, file_id)
    content = await owned_content(files, tenant, file_id)  # 404 too where it expired between the reads
    return Response(content, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{_header_safe(stored.filename)}"'})


@router.delete("/v1/files/{file_id}", responses=json_answer(FileDeleted, "The file is gone."))
async def delete_file(file_id: str, tenant: TenantDep, store: StoreDep, settings: SettingsDep):
    files = file_store(store, settings)
    if not FILE_ID.match(file_id) or not await files.delete(tenant, file_id):
        raise ApiError(404, f"no file {file_id!r}", param="file_id", code="not_found")
    return {"id": file_id, "object": "file", "deleted": True}


def _header_safe(name: str) -> str:
    """A file name fit for a quoted header value: printable ASCII without quotes or backslashes."""
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name) or "file"
