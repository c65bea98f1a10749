"""Who is calling: the tenant of the Bearer key (or the `x-api-key` header's), when auth is on.

Auth is on whenever the api binds beyond loopback (`auth=auto`), unless the operator turns it
off explicitly (`STREAMQ_AUTH=off`). With auth off every caller is the anonymous tenant "".
"""
from __future__ import annotations

import ipaddress
from typing import Annotated

from fastapi import Depends, Request

from api.core.deps import ReplicaDep
from api.core.errors import ApiError


def auth_enabled(mode: str, host: str) -> bool:
    if mode != "auto":
        return mode == "on"
    if host in ("localhost",):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable from outside
        return True


async def tenant(request: Request, replica: ReplicaDep) -> str:
    store = replica.keys
    if store is None:
        return ""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if not header and request.headers.get("x-api-key"):  # Anthropic's clients send their key so
        scheme, key = "bearer", request.headers["x-api-key"]
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    found = await store.tenant_for(key.strip())
    if found is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return found


TenantDep = Annotated[str, Depends(tenant)]
