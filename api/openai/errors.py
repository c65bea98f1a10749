"""OpenAI's error body, which every OpenAI path answers errors in (api/app.py)."""
from __future__ import annotations

# The paths whose errors take OpenAI's body (besides Responses', pooling's and the adapters').
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/batches", "/v1/files")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ("rate_limit_error" if status == 429 else "invalid_request_error") if status < 500 else (
        "overloaded_error" if status == 503 else "server_error")
    if status == 404 and code is None:
        code = "not_found"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
