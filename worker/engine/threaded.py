"""The built-in engines (Engine, StaticEngine, NullEngine: worker/engine/base.py BaseEngine) as a
Backend: each step runs in the model's own thread."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.messages import RequestPayload, TokenEvent
from worker.engine.backend import Backend, Counts
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import ExecutionPlan
from worker.engine.sequence import Sequence, StepOutput


class Threaded(Backend):
    """A built-in engine (Engine, StaticEngine, NullEngine: worker/engine/base.py BaseEngine) as a
    Backend: its blocking step runs in a thread, so intake, cancels and heartbeats keep going while
    the model computes.

    Always the same thread, the model's own. An OpenMP runtime gives every thread that opens a
    parallel region its own team of workers, and a team's workers spin a while after each region
    (KMP_BLOCKTIME, 200 ms in Intel's runtime). Steps handed to asyncio's shared executor landed
    on whichever of its threads was idle, so two teams took turns, each spinning on the cores the
    other computed on: on 2 cores the worker ran 4 busy threads, and W through the whole stack
    went at 0.8 of the same engine in-process (bf16; benchmarks/backends.py)."""

    def __init__(self, engine: BaseEngine, name: str, thread: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.name = name
        self.batch_size = engine.batch_size
        self._thread = thread or model_thread()

    @classmethod
    async def build(cls, make: Callable[[], BaseEngine], name: str) -> Threaded:
        """The engine `make` returns, made in the thread that will step it."""
        thread = model_thread()
        return cls(await asyncio.get_running_loop().run_in_executor(thread, make), name, thread)

    @property
    def pools(self) -> bool:  # its engine's class says
        return self.engine.pools

    @property
    def lora(self) -> bool:  # its engine's class says
        return self.engine.lora

    @property
    def last_step_size(self) -> int:
        return self.engine.last_step_size

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        return self.engine.add(payload, resumed)

    @property
    def takes_images(self) -> bool:
        return bool(getattr(self.engine, "takes_images", False))

    def add_with_images(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple, images: list[bytes]
                        ) -> Sequence:
        return self.engine.add(payload, resumed, images)

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
        return self.engine.batch_invariant

    @property
    def adapters(self) -> list[str] | None:
        registry = self.engine.adapters
        return registry.servable() if registry is not None else None

    def learn_adapters(self, runtime: dict[str, Path]) -> None:
        registry = self.engine.adapters
        if registry is None:
            raise NotImplementedError(f"the {self.name} engine serves no LoRA adapters")
        registry.learn(runtime)

    @property
    def plan(self) -> ExecutionPlan:
        return self.engine.plan

    @property
    def weight_bytes(self) -> int | None:
        return self.engine.weight_bytes

    def counts(self) -> Counts:
        return self.engine.counts()

    def phase_seconds(self) -> dict[str, float]:
        return dict(self.engine.phase_seconds)

    async def close(self) -> None:
        self._thread.shutdown(wait=False)


def model_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamq-model")
