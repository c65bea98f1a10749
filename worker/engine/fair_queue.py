"""The waiting requests of one worker, handed out by service tier, then in weighted fair share
between tenants.

Pure Python. A request of a better service tier (shared/service_tier.py) goes before any of a
worse one, whatever its tenant. Within a tier, each tenant has a virtual time: the tokens the batcher has scheduled for it,
divided by its weight. The next request admitted is the head of the tenant with the smallest
virtual time, so a tenant that has had less than its share goes first, however long another
tenant's backlog is (start-time fair queueing): the tenant's virtual time is one, over its
requests of every tier. A tenant that was idle starts at the current
virtual clock, not at its old time, so idleness is not saved up as credit. Within a tenant,
requests go by priority (lower first), then by arrival. A request still waiting for its
grammar (Status.WAITING_FOR_GRAMMAR) keeps its place but is passed over until it is ready, as
vLLM's scheduler skips its WAITING_FOR_FSM requests.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from worker.engine.sequence import Sequence, Status


class FairQueue:
    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[int, int, int, Sequence]]] = {}  # tenant -> (tier, priority, arrival, seq)
        self._vtime: dict[str, float] = {}
        self._clock = 0.0  # virtual time of the last admission: where a newly busy tenant starts
        self._arrivals = itertools.count()
        self._len = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request; a preempted one keeps its place of first arrival."""
        tenant = seq.tenant
        heap = self._heaps.setdefault(tenant, [])
        if not heap:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self._clock)
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)
        heapq.heappush(heap, (seq.tier, seq.priority, seq.arrival, seq))
        self._len += 1

    def peek(self) -> Sequence | None:
        """The request to admit next, or None (none waits, or all wait for their grammar)."""
        head = self._next()
        return None if head is None else head[1]

    def pop(self) -> Sequence:
        """Take the request peek() names."""
        head = self._next()
        if head is None:
            raise IndexError("pop from a FairQueue with no request ready")
        tenant, seq = head
        self._clock = max(self._clock, self._vtime[tenant])
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        heap = self._heaps.get(seq.tenant, [])
        if heap and heap[0][-1] is seq:
            heapq.heappop(heap)
            self._len -= 1
            return
        for i, (*_, queued) in enumerate(heap):
            if queued is seq:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                self._len -= 1
                return
        raise ValueError(f"request {seq.id} is not waiting")

    def charge(self, seq: Sequence, tokens: int) -> None:
        """`tokens` of this request's tenant were scheduled in a step."""
        tenant = seq.tenant
        self._vtime[tenant] = self._vtime.get(tenant, self._clock) + tokens / seq.weight

    def virtual_time(self, tenant: str) -> float:
        return self._vtime.get(tenant, 0.0)

    def _next(self) -> tuple[str, Sequence] | None:
        """(tenant, request): of the tenants' first ready requests, those of the best tier, and of
        them the one of the tenant with the smallest virtual time."""
        heads = []
        for tenant, heap in self._heaps.items():
            head = heap[0] if heap and _ready(heap[0][-1]) else min((e for e in heap if _ready(e[-1])), default=None)
            if head is not None:
                heads.append((head[0], self._vtime[tenant], head[2], tenant, head[-1]))
        if not heads:
            return None
        *_, tenant, seq = min(heads, key=lambda h: h[:4])
        return tenant, seq

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting request, in no particular order."""
        for heap in self._heaps.values():
            for *_, seq in heap:
                yield seq

    def __contains__(self, seq: object) -> bool:
        return any(queued is seq for queued in self)


def _ready(seq: Sequence) -> bool:
    return seq.status is not Status.WAITING_FOR_GRAMMAR
