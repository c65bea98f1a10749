"""What the worker's service needs from a backend (`Backend`, an abstract base class), and the
backend of the built-in engines (worker/engine/threaded.py `Threaded`).

The service (intake, publishing, heartbeats, cancellation, recovery) is the same for every
backend. A backend takes requests (`add`), stops them (`cancel`), and hands back the events of
its next step (`step`): one token or more per running request, and the requests that ended.
The built-in engines step synchronously (a model forward), so they run in a thread behind
`Threaded`; the vLLM backend is asyncio-native.

What a backend may lack is said by the backend itself, never probed: `pools` and `lora` are
class-level flags, and the readings it may not have (`kv_blocks`, `counts`, `phase_seconds`,
`batch_invariant`) have the answer of a backend without them here, which one that has them overrides.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shared.messages import RequestPayload, TokenEvent
from worker.engine.execution_plan import ExecutionPlan
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


class Backend(abc.ABC):
    """A worker's model side, as its service calls it. A subclass that leaves out an abstract
    method cannot be made."""

    pools: ClassVar[bool] = False  # it runs pooling requests (RequestPayload.pool: embeddings, rerank)
    lora: ClassVar[bool] = False  # it can serve LoRA adapters (`adapters` says whether it does now)

    name: str

    @property
    def takes_images(self) -> bool:
        """Whether its model is a vision-language model that runs a request's images (add_with_images)."""
        return False

    def add_with_images(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple, images: list[bytes]
                        ) -> Sequence:
        """Take a request with its images' bytes (RequestPayload.images, in order), where takes_images."""
        raise NotImplementedError(f"the {self.name} backend takes no images")
    batch_size: int

    @abc.abstractmethod
    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        """Take a request (continuing after `resumed`, the tokens another worker delivered)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """End a request at the next step (it comes back from step() with finish reason cancelled)."""

    @property
    @abc.abstractmethod
    def free_slots(self) -> int:
        """Requests it can take now."""

    @property
    @abc.abstractmethod
    def running(self) -> list[Sequence]:
        """The requests in its running batch."""

    @property
    @abc.abstractmethod
    def waiting(self) -> list[Sequence]:
        """The requests it took that do not run yet."""

    @property
    @abc.abstractmethod
    def last_step_size(self) -> int:
        """Requests in the last step, for metrics."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether it holds a request (a step has something to do)."""

    @abc.abstractmethod
    async def step(self) -> list[StepOutput]:
        """The next events; waits for them while requests run."""

    @abc.abstractmethod
    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with an error (the step itself failed)."""

    @property
    @abc.abstractmethod
    def plan(self) -> ExecutionPlan:
        """The paths its engine takes (worker/engine/execution_plan.py)."""

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of weights a step reads, as held (quantized ones packed), where it knows them."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Let go of what it holds (its thread, its engine process)."""

    def kv_blocks(self) -> tuple[int, int] | None:
        """(free, total) KV-cache blocks; None where it does not know them."""
        return None

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's result depends on its own sequence only, so that a continuation after
        a failover gives the undisturbed tokens (PagedRunner.batch_invariant)."""
        return False

    @property
    def adapters(self) -> list[str] | None:
        """The LoRA adapters it serves (worker/model/lora.py), for the heartbeat; None where it serves none
        (LoRA not enabled, or a backend without it)."""
        return None

    def learn_adapters(self, runtime: dict[str, Path]) -> None:
        """The adapters loaded at run time for its model (Adapters.learn); called only where `adapters`
        is not None."""
        raise NotImplementedError(f"the {self.name} backend serves no LoRA adapters")

    def counts(self) -> Counts:
        """Its running totals, read after each step (zeros where it keeps none)."""
        return Counts()

    def phase_seconds(self) -> dict[str, float]:
        """Seconds its steps spent in each phase, summed so far (worker/engine/core.py's STEP_PHASES);
        empty where it does not split them."""
        return {}
