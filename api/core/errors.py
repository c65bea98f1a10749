"""The api's client error: raised anywhere in the api, rendered by each endpoint family its own way."""
from __future__ import annotations


class ApiError(Exception):
    """A client error with its HTTP status; each endpoint family renders it its own way."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
