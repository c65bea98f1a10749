"""What the worker's service needs from a backend, and the adapter for the built-in engines.

The service (intake, publishing, heartbeats, cancellation, recovery) is the same for every
backend. A backend takes requests (`add`), stops them (`cancel`), and hands back the events of
its next step (`step`): one token or more per running request, and the requests that ended.
The built-in engines step synchronously (a model forward), so they run in a thread behind
`Threaded`; the vLLM backend is asyncio-native.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.messages import RequestPayload, TokenEvent
from worker.engine.execution_plan import ExecutionPlan, plan_of
from worker.engine.kv_tier import TierCounts
from worker.engine.sequence import Sequence, StepOutput


@dataclass(frozen=True)
class Counts:
    """Running totals a backend keeps, for the worker's metrics; zero where it has no such thing
    (only the paged engine shares prefixes, preempts and speculates)."""

    prefix_queries: int = 0  # prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of which found
    preemptions: int = 0
    spec_drafts: int = 0  # decodes that carried proposed tokens
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_tier: TierCounts | None = None  # the shared KV tier's, where it is on


class Backend(Protocol):
    name: str
    batch_size: int
    pools: bool  # whether it runs pooling requests (RequestPayload.pool: embeddings, rerank)
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

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's result depends on its own sequence only, so that a continuation after
        a failover gives the undisturbed tokens (PagedRunner.batch_invariant)."""

    @property
    def adapters(self) -> list[str] | None:
        """The LoRA adapters it serves (worker/model/lora.py), for the heartbeat; None where it serves none
        (LoRA not enabled, or a backend without it)."""

    def learn_adapters(self, runtime: dict[str, Path]) -> None:
        """The adapters loaded at run time for its model (Adapters.learn), where it serves LoRA."""

    @property
    def plan(self) -> ExecutionPlan:
        """The paths its engine takes (worker/engine/execution_plan.py)."""

    def counts(self) -> Counts:
        """Its running totals, read after each step."""

    def phase_seconds(self) -> dict[str, float]:
        """Seconds its steps spent in each phase, summed so far (worker/engine/core.py's STEP_PHASES);
        empty where it does not split them."""


class Threaded:
    """A built-in engine (Engine, StaticEngine, NullEngine) as a Backend: its blocking step runs
    in a thread, so intake, cancels and heartbeats keep going while the model computes.

    Always the same thread, the model's own. An OpenMP runtime gives every thread that opens a
    parallel region its own team of workers, and a team's workers spin a while after each region
    (KMP_BLOCKTIME, 200 ms in Intel's runtime). Steps handed to asyncio's shared executor landed
    on whichever of its threads was idle, so two teams took turns, each spinning on the cores the
    other computed on: on 2 cores the worker ran 4 busy threads, and W through the whole stack
    went at 0.8 of the same engine in-process (bf16; benchmarks/backends.py)."""

    def __init__(self, engine: Any, name: str, thread: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.name = name
        self.batch_size = engine.batch_size
        self.pools = engine.pools
        self._thread = thread or model_thread()

    @classmethod
    async def build(cls, make: Callable[[], Any], name: str) -> Threaded:
        """The engine `make` returns, made in the thread that will step it."""
        thread = model_thread()
        return cls(await asyncio.get_running_loop().run_in_executor(thread, make), name, thread)

    @property
    def last_step_size(self) -> int:
        return self.engine.last_step_size

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
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.engine.step)

    def fail_all(self, error: str) -> list[StepOutput]:
        return self.engine.fail_all(error)

    def kv_blocks(self) -> tuple[int, int] | None:
        return self.engine.kv_blocks()

    @property
    def batch_invariant(self) -> bool:
        return getattr(getattr(self.engine, "runner", None), "batch_invariant", False)  # the paged engine's

    @property
    def adapters(self) -> list[str] | None:
        registry = self._registry()
        return registry.servable() if registry is not None else None

    def learn_adapters(self, runtime: dict[str, Path]) -> None:
        if (registry := self._registry()) is not None:
            registry.learn(runtime)

    @property
    def plan(self) -> ExecutionPlan:
        return plan_of(self.engine)

    def _registry(self):
        return getattr(getattr(self.engine, "runner", None), "adapters", None)  # the paged engine's, where on

    def counts(self) -> Counts:
        return self.engine.counts()

    def phase_seconds(self) -> dict[str, float]:
        return dict(getattr(self.engine, "phase_seconds", {}))  # the paged engine's; the others keep none

    async def close(self) -> None:
        self._thread.shutdown(wait=False)


def model_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamq-model")
