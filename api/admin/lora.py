"""Loading and unloading LoRA adapters at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), for the operator only (api/core/auth.py: the admin tenant's key, or
a loopback Host with auth off). An adapter loaded here is written to the model's registry in
Redis (shared/lora_registry.py): every worker of the model reads it at its heartbeat and loads
the adapter on its first request; every replica serves it."""
from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.core.auth import AdminDep
from api.core.deps import ModelsDep, ReplicaDep
from api.core.errors import ApiError
from api.admin.answers import AdapterLoaded, AdapterUnloaded
from api.core.json_body import StrictJSONRoute
from api.core.openapi import json_answer
from shared.lora_registry import AdapterEntry, LoraRegistry

router = APIRouter(tags=["lora"], route_class=StrictJSONRoute)
PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
NAME = r"^[^\s,=/]{1,256}$"


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=NAME)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = Field(None, description="The base model (the replica's own by default).")
    tenants: list[str] | None = Field(None, max_length=1000, description="Only these tenants may use it.")


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=NAME)
    model: str | None = None


@router.post("/v1/load_lora_adapter", responses=json_answer(AdapterLoaded, "Registered for every worker of the model."))
async def load_adapter(body: LoadAdapter, replica: ReplicaDep, served: ModelsDep, _admin: AdminDep):
    base = await served.get(body.model)
    if base.adapter is not None:
        raise ApiError(400, f"model {body.model!r} is an adapter; name its base model", param="model")
    if body.lora_name in await served.served() or served.loaded(body.lora_name) is not None:
        raise ApiError(400, f"{body.lora_name!r} is a model's name", param="lora_name")
    await run_in_threadpool(_check_folder, Path(body.lora_path))  # a file read: off the event loop
    entry = AdapterEntry(path=body.lora_path, tenants=tuple(body.tenants) if body.tenants is not None else None)
    await LoraRegistry(replica.store.redis, replica.settings.prefix).register(base.base_model, body.lora_name, entry)
    return {"object": "lora_adapter", "id": body.lora_name, "parent": base.base_model, "root": body.lora_path,
            "status": "loaded"}


@router.post("/v1/unload_lora_adapter", responses=json_answer(AdapterUnloaded, "Removed from the model's registry."))
async def unload_adapter(body: UnloadAdapter, replica: ReplicaDep, served: ModelsDep, _admin: AdminDep):
    base = await served.get(body.model)
    if not await LoraRegistry(replica.store.redis, replica.settings.prefix).unregister(base.base_model, body.lora_name):
        raise ApiError(404, f"no adapter {body.lora_name!r} was loaded at run time for {base.base_model!r} "
                            "(adapters of STREAMQ_LORA_MODULES stay with their workers)", param="lora_name")
    return {"object": "lora_adapter", "id": body.lora_name, "parent": base.base_model, "status": "unloaded"}


def _check_folder(path: Path) -> None:
    """A peft adapter folder, as this replica sees it (the workers read the same path: a shared
    volume in a deployment); its weights are checked by the worker that loads it."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ApiError(400, f"lora_path {str(path)!r} has no readable adapter_config.json ({exc})",
                       param="lora_path") from exc
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ApiError(400, f"lora_path {str(path)!r} holds a {config.get('peft_type')!r} adapter, not LORA",
                       param="lora_path")
