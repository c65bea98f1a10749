"""What the worker's service needs from a backend, and the adapter for the built-in engines.

The service (intake, publishing, heartbeats, cancellation, recovery) is the same for every
backend. A backend takes requests (`add`), stops them (`cancel`), and hands back the events of
its next step (`step`): one token or more per running request, and the requests that ended.
The built-in engines step synchronously (a model forward), so they run in a thread behind
`Threaded`; the vLLM backend is asyncio-native.
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

from shared.messages import RequestPayload, TokenEvent
from worker.sequence import Sequence, StepOutput


class Backend(Protocol):
    name: str
    batch_size: int
    last_step_size: int  # requests in the last step, for metrics

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        """Take a request (continuing after `resumed`, the tokens another worker delivered)."""

    def cancel(self, request_id: str) -> None:
        """End a request at the next step (it comes back from step() with finish reason cancelled)."""

    @property
    def free_slots(self) -> int: ...

    @property
    def running(self) -> list[Sequence]: ...

    @property
    def waiting(self) -> list[Sequence]: ...

    def has_work(self) -> bool: ...

    async def step(self) -> list[StepOutput]:
        """The next events; waits for them while requests run."""

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with an error (the step itself failed)."""

    def kv_blocks(self) -> tuple[int, int] | None:
        """(free, total) KV-cache blocks, when the backend knows them."""


class Threaded:
    """A built-in engine (Engine, StaticEngine, NullEngine) as a Backend: its blocking step runs
    in a thread, so intake, cancels and heartbeats keep going while the model computes."""

    def __init__(self, engine: Any, name: str):
        self.engine = engine
        self.name = name
        self.batch_size = engine.batch_size

    @property
    def batcher(self) -> Any:
        """The engine's batcher when it has one (its cache and preemption figures feed metrics)."""
        return getattr(self.engine, "batcher", None)

    @property
    def speculator(self) -> Any:
        """The paged engine's speculator when speculative decoding is on (its counts feed metrics)."""
        return getattr(self.engine, "speculator", None)

    @property
    def last_step_size(self) -> int:
        return getattr(self.engine, "last_step_size", 0)

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        return self.engine.add(payload, resumed)

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    @property
    def running(self) -> list[Sequence]:
        return list(self.engine.running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.engine.waiting)

    def has_work(self) -> bool:
        return self.engine.has_work()

    async def step(self) -> list[StepOutput]:
        return await asyncio.to_thread(self.engine.step)

    def fail_all(self, error: str) -> list[StepOutput]:
        return self.engine.fail_all(error)

    def kv_blocks(self) -> tuple[int, int] | None:
        batcher = self.batcher
        if batcher is None:
            return None
        return batcher.blocks.num_free, len(batcher.blocks.blocks)
