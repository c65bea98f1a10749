"""The ids the api hands out (requests, responses, batches, messages), each made and recognised here.

Every id is a fresh UUID4 in one spelling: a request's is `str(uuid4())` (lowercase, hyphenated),
the others are a prefix and its 32 lowercase hex digits. A route that looks an id up first checks
it is in its form and answers 404 otherwise, at once: another spelling of a real id (upper case,
padded, braced, a `urn:uuid:`) is not that id, and must not reach Redis as a different key.
"""
from __future__ import annotations

import re
import uuid

# A UUID4's 32 hex digits, lowercase: version 4, variant 10xx.
_HEX = r"[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}"
_REQUEST = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_RESPONSE = re.compile(f"resp_{_HEX}")
_BATCH = re.compile(f"batch_{_HEX}")


def request_id() -> str:
    """A new request's id (the native api's, and every queued request's)."""
    return str(uuid.uuid4())


def is_request_id(text: str) -> bool:
    return _REQUEST.fullmatch(text) is not None


def response_id() -> str:
    """A new response's id (the Responses API)."""
    return f"resp_{uuid.uuid4().hex}"


def is_response_id(text: str) -> bool:
    return _RESPONSE.fullmatch(text) is not None


def batch_id() -> str:
    """A new offline batch's id."""
    return f"batch_{uuid.uuid4().hex}"


def is_batch_id(text: str) -> bool:
    return _BATCH.fullmatch(text) is not None


def message_id() -> str:
    """A new Messages API message's id (never looked up: a message is not stored)."""
    return f"msg_{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    """A new chat completion's id (never looked up)."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    """A new completion's id (never looked up)."""
    return f"cmpl-{uuid.uuid4().hex}"
