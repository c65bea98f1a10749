"""`GET /v1/models`: the models served, and their LoRA adapters."""
from __future__ import annotations

from fastapi import APIRouter

from api.core.auth import TenantDep
from api.core.deps import ModelsDep
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import ModelList, OpenAIError

router = APIRouter(tags=["openai"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))


@router.get("/v1/models", responses=json_answer(ModelList, "The models served, then their adapters."))
async def models(served: ModelsDep, tenant: TenantDep):
    """The models that have a live worker, and their LoRA adapters (`parent`: the base model)."""
    data = []
    for name in sorted(await served.served()):
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "streamq"}
        if (loaded := served.loaded(name)) is not None:
            entry["max_model_len"] = loaded.tokenizer.context_length
        data.append(entry)
    for name, adapter in sorted((await served.adapters()).items()):
        entry = adapter.entry
        if entry is None or entry.allows(tenant):  # a tenant sees only the adapters it may use
            # No `root`: an adapter's folder is the operator's business, never a caller's.
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "streamq", "parent": adapter.base})
    return {"object": "list", "data": data}
