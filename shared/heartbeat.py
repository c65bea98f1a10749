"""A worker's heartbeat: the one message between a worker and everyone that counts the workers.

A worker writes it every heartbeat interval to its key with a TTL (shared/redis_keys.worker_heartbeat);
the api (/readyz, /v1/cluster, the served models, the fleet gauges, the pooling and backend
checks), the api's prefix routing and the reclaim of dead workers read it. It is encoded and
decoded here only (`Heartbeat.encode`, `Heartbeat.decode`); the JSON keys are those a heartbeat
had before it carried a version, so a reader of the previous version reads this one too.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.messages import Versioned

# Keys written only where the backend knows its KV cache (the built-in paged engine).
_KV_KEYS = frozenset({"kv_blocks_free", "kv_blocks_total"})


class Heartbeat(Versioned):
    """What a live worker says of itself."""

    worker: str  # its name (STREAMQ_WORKER_NAME)
    model: str  # the served model's name
    backend: str  # hf | vllm | null
    capacity: int = Field(ge=0)  # its batch size
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)  # taken by it, not running yet
    metrics_port: int | None  # its /metrics port (None: metrics off)
    deterministic: bool  # STREAMQ_DETERMINISTIC
    batch_invariant: bool  # a token's result depends on its own sequence only
    pools: bool  # it runs pooling requests (embeddings, rerank)
    lora: bool  # it serves LoRA adapters
    adapters: list[str]  # the adapters it serves now (empty without LoRA)
    plan: dict[str, str]  # its execution plan's labels (worker/engine/execution_plan.py)
    kv_blocks_free: int | None = None  # None, and left out: a backend that does not say
    kv_blocks_total: int | None = None
    at: float  # when the running totals below were read (seconds since the epoch)
    generated_tokens: int = Field(ge=0)  # running totals since the worker started
    ttft_sum_s: float = Field(ge=0)
    ttft_count: int = Field(ge=0)

    def wire(self) -> dict[str, Any]:
        """As JSON keeps it: what the api's /readyz and /v1/cluster show of each worker."""
        absent = _KV_KEYS if self.kv_blocks_free is None else set()
        return self.model_dump(mode="json", exclude=absent)

    def encode(self) -> str:
        absent = _KV_KEYS if self.kv_blocks_free is None else set()
        return self.model_dump_json(exclude=absent)
