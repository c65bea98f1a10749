"""Who is calling: the tenant of the Bearer key (or the `x-api-key` header's), when auth is on;
and whether the caller is the operator (the admin tenant's key; with auth off, a loopback Host).

Auth is on whenever the api binds beyond loopback (`auth=auto`), unless the operator turns it
off explicitly (`STREAMQ_AUTH=off`). With auth off every caller is the anonymous tenant "".
"""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.core.deps import Replica, ReplicaDep
from api.core.errors import ApiError
from api.core.hosts import host_name, is_loopback


def auth_enabled(mode: str, host: str) -> bool:
    if mode != "auto":
        return mode == "on"
    return not is_loopback(host)


def _key(request: Request) -> str | None:
    """The key the request sends, None without one; 401 for an Authorization header of another scheme."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if not header and request.headers.get("x-api-key"):  # Anthropic's clients send their key so
        scheme, key = "bearer", request.headers["x-api-key"]
    if not header and not key:
        return None
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key.strip()


async def tenant(request: Request, replica: ReplicaDep) -> str:
    store = replica.keys
    if store is None:
        return ""
    key = _key(request)
    if key is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    found = await store.tenant_for(key)
    if found is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return found


TenantDep = Annotated[str, Depends(tenant)]


async def admitted(tenant: TenantDep, replica: ReplicaDep) -> str:
    """The caller's tenant, once its limits let one more request in (429 otherwise). A dependency,
    so FastAPI decides it before it validates the body: a tenant past its limits is refused before
    its constraints compile or its prompt is tokenized (Limits.admit; the charge decides for good)."""
    limits = replica.generation.limits
    if limits is not None and tenant:
        await limits.admit(tenant)
    return tenant


AdmittedDep = Annotated[str, Depends(admitted)]


async def _is_admin(request: Request, replica: Replica) -> bool:
    """The admin tenant's key with auth on (401 for a missing or wrong one); a loopback Host with it
    off, since only a program on this machine, or a page it opened by that name, sends one."""
    if replica.keys is None:
        return is_loopback(host_name(request.headers.get("host", "")))
    return await tenant(request, replica) == replica.settings.admin_tenant


async def admin(request: Request, replica: ReplicaDep) -> None:
    """The operator's routes (LoRA adapters, the cluster view): 403 for anyone else."""
    if await _is_admin(request, replica):
        return
    if replica.keys is None:
        raise ApiError(403, "with API keys off, the operator's routes answer only requests to a loopback name "
                            "(Host: localhost, 127.0.0.1 or [::1])", code="forbidden")
    raise ApiError(403, f"the operator's routes are for the {replica.settings.admin_tenant!r} tenant's keys "
                        "(STREAMQ_ADMIN_TENANT)", code="forbidden")


async def sees_details(request: Request, replica: ReplicaDep) -> bool:
    """Whether an open route (/readyz) may show the fleet's details: to the operator only. Without a
    key, no details and no 401 (probes send none); a key that is sent is checked as on every route."""
    if replica.keys is not None and _key(request) is None:
        return False
    return await _is_admin(request, replica)


AdminDep = Annotated[None, Depends(admin)]
SeesDetailsDep = Annotated[bool, Depends(sees_details)]
