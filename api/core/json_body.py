"""Request bodies parsed as strict JSON, so odd input gets a 4xx naming where it is, never a 5xx.

Python's json accepts what no later step can handle: NaN, Infinity and 1e999 (read as inf:
the 422 that echoes them cannot be encoded), lone surrogates such as "\\ud800" (the tokenizer,
Redis and every response refuse them), integers of thousands of digits and nesting down to the
interpreter's recursion limit. The routes' class refuses them before FastAPI validates the body.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

MAX_DEPTH = 32  # the deepest real body (a batch of chat messages with content parts) needs 8

# Only a body with one of these can hold a surrogate; the others skip the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _invalid(loc: tuple, kind: str, msg: str, value: Any = None, **ctx: str) -> RequestValidationError:
    error = {"type": kind, "loc": loc, "msg": msg, "input": value}
    return RequestValidationError([{**error, "ctx": ctx} if ctx else error])


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def loads(body: bytes) -> Any:
    """The body as JSON; RequestValidationError (422, or OpenAI's 400) naming what is not strict JSON."""
    non_finite = False

    def number(text: str) -> float:
        nonlocal non_finite
        value = float(text)
        non_finite |= not math.isfinite(value)
        return value

    try:
        value = json.loads(body, parse_float=number, parse_constant=number)
    except RecursionError:
        raise _invalid(("body",), "json_invalid", f"JSON nested more than {MAX_DEPTH} levels deep", {}) from None
    except json.JSONDecodeError as exc:  # FastAPI's own shape for malformed JSON
        raise _invalid(("body", exc.pos), "json_invalid", "JSON decode error", {}, error=exc.msg) from None
    except ValueError as exc:  # not UTF-8, or an integer past Python's 4300 digits
        raise _invalid(("body",), "json_invalid", "JSON decode error", {}, error=str(exc)) from None
    if non_finite or _SURROGATE_ESCAPE.search(body) or body.count(b"[") + body.count(b"{") > MAX_DEPTH:
        _check(value)
    return value


def _check(value: Any) -> None:
    """Walk the parsed body (without recursion) for what `loads` refuses."""
    stack: list[tuple[Any, tuple]] = [(value, ("body",))]
    while stack:
        item, loc = stack.pop()
        if len(loc) > MAX_DEPTH + 1:
            raise _invalid(loc[:MAX_DEPTH + 1], "json_invalid", f"JSON nested more than {MAX_DEPTH} levels deep", {})
        if isinstance(item, float) and not math.isfinite(item):
            raise _invalid(loc, "finite_number", "Input should be a finite number", str(item))
        if isinstance(item, str) and _printable(item) != item:
            raise _invalid(loc, "string_unicode", "Input should be valid Unicode text (it has a lone surrogate)",
                           _printable(item))
        if isinstance(item, dict):
            for key, child in item.items():
                if _printable(key) != key:
                    raise _invalid((*loc, _printable(key)), "string_unicode",
                                   "Keys should be valid Unicode text (this one has a lone surrogate)", {})
                stack.append((child, (*loc, key)))
        elif isinstance(item, list):
            stack.extend((child, (*loc, i)) for i, child in enumerate(item))


def _is_json(request: Request) -> bool:
    """Whether FastAPI would parse this body as JSON (no content type, or a JSON one)."""
    kind = request.headers.get("content-type")
    if not kind:
        return True
    main, _, sub = kind.split(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = loads(await self.body())
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `loads`, once, before FastAPI's handler validates it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            request = _StrictRequest(request.scope, request.receive)
            if _is_json(request) and await request.body():
                await request.json()  # raised here, a RequestValidationError reaches the app's handlers
            return await handler(request)

        return strict
