"""The operator's answers as /openapi.json documents them (api/core/openapi.py): health,
readiness, adapters loaded and unloaded, the cluster view."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer
from shared.heartbeat import Heartbeat  # the contract itself: what the worker wrote

MODEL = "SmolLM2-135M-Instruct"
BEAT = {"version": 1, "worker": "worker-1", "model": MODEL, "backend": "hf", "capacity": 16, "running": 1,
        "waiting": 0, "metrics_port": 9100, "deterministic": False, "batch_invariant": True, "pools": True,
        "lora": False, "adapters": [], "plan": {"forward": "kernels"}, "kv_blocks_free": 900, "kv_blocks_total": 1024,
        "at": 1767225600.0, "generated_tokens": 1200, "ttft_sum_s": 3.1, "ttft_count": 20}


class Healthy(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"]


class Ready(Answer):
    """Redis answers and at least one live worker serves the model; the model and its workers for
    the operator only (the admin tenant's key, or a loopback Host with keys off)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ready", "model": MODEL, "workers": [BEAT]},
                                                              {"status": "ready"}]})

    status: Literal["ready"]
    model: str | None = Field(None, description="The operator's only.")
    workers: list[Heartbeat] | None = Field(None, description="The operator's only.")


class NotReady(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"status": "unavailable", "reason": f"no live worker serves {MODEL}"}]})

    status: Literal["unavailable"]
    reason: str


class AdapterLoaded(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"object": "lora_adapter", "id": "sql", "parent": MODEL, "root": "/adapters/sql", "status": "loaded"}]})

    object: Literal["lora_adapter"]
    id: str
    parent: str = Field(description="Its base model.")
    root: str = Field(description="Its folder, as the workers read it.")
    status: Literal["loaded"]


class AdapterUnloaded(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"object": "lora_adapter", "id": "sql", "parent": MODEL, "status": "unloaded"}]})

    object: Literal["lora_adapter"]
    id: str
    parent: str
    status: Literal["unloaded"]


class Backlog(Answer):
    waiting: int = Field(description="Requests for the model that wait for a worker.")


class Cluster(Answer):
    """The live workers (their heartbeats) and the model's backlog; the playground polls it."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": MODEL, "workers": [BEAT], "queue": {"waiting": 0}}]})

    model: str
    workers: list[Heartbeat]
    queue: Backlog
