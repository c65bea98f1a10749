"""The operator's answers as /openapi.json documents them (api/core/openapi.py): health,
readiness, adapters loaded and unloaded, the cluster view."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer

MODEL = "SmolLM2-135M-Instruct"
BEAT = {"worker": "worker-1", "model": MODEL, "backend": "hf", "capacity": 16, "running": 1, "waiting": 0,
        "at": 1767225600.0}


class Healthy(Answer):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"]


class Heartbeat(Answer):
    """A live worker's heartbeat: these fields, and its running totals and settings besides."""

    model_config = ConfigDict(extra="allow")

    worker: str
    model: str
    backend: str
    capacity: int = Field(description="Requests it runs at once.")
    running: int
    waiting: int
    at: float = Field(description="When its totals were read (seconds since the epoch).")


class Ready(Answer):
    """Redis answers and at least one live worker serves the model."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ready", "model": MODEL, "workers": [BEAT]}]})

    status: Literal["ready"]
    model: str
    workers: list[Heartbeat]


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
