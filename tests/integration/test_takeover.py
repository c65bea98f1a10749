"""A takeover against a real Redis (the worker's claims and publisher, the scheduler's reclaim): the
worker that took a request over goes on after the last index delivered, and the worker that lost
it writes nothing more of it, its final event included."""
from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace

from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import FinalEvent, FinishReason, RequestPayload, RequestStatus, TokenEvent, decode_event
from shared.queue import RequestQueue, lane_of
from shared.reclaim import reclaim_dead_workers
from shared.sampling import SamplingParams
from shared.store import RequestStore, delivered_tokens
from worker.engine.sequence import RequestEnd, StepOutput
from worker.service.claims import Claims
from worker.service.lease import Lease
from worker.service.metrics import WorkerMetrics
from worker.service.publisher import Publisher
from worker.service.tracing import RequestSpans

MODEL = "m"


class Worker:
    """One worker's claims and publisher, over a backend that only records what it is given."""

    def __init__(self, redis, prefix: str, name: str, lease: Lease | None = None):
        self.redis, self.name, self.added = redis, name, []
        self.queue = RequestQueue(redis, prefix, MODEL)
        self.store = RequestStore(redis, prefix)
        self.publisher = Publisher(redis, self.queue, name, lease)
        backend = SimpleNamespace(add=lambda payload, resumed: self.added.append(list(resumed)), pools=False,
                                  adapters=None, name="stub")
        self.claims = Claims(redis, self.store, backend, self.publisher, WorkerMetrics(), RequestSpans(name), name,
                             lambda: [])

    async def take(self, payload: RequestPayload) -> list[int]:
        """Read the request's entry from its lane and claim it; the indexes it continues after."""
        stream = self.queue.stream_of(payload)
        [[_, [(entry_id, fields)]]] = await self.redis.xreadgroup(redis_keys.WORKER_GROUP, self.name, {stream: ">"})
        assert await self.claims.claim(stream, entry_id, fields) is not None
        return [e.index for e in self.added[-1]]

    async def publish(self, payload: RequestPayload, *tokens: TokenEvent, end: str | None = None) -> list[str]:
        outs = [StepOutput(payload.id, t, False, lane=lane_of(payload)) for t in tokens]
        if end is not None:
            outs.append(StepOutput(payload.id, None, True, lane=lane_of(payload),
                                   end=RequestEnd(FinishReason.LENGTH, None, end, 3, len(tokens))))
        return await self.publisher.publish(outs)


def _payload() -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model=MODEL, prompt_token_ids=[1, 2, 3],
                          params=SamplingParams(max_tokens=50))


def _token(index: int, token_id: int) -> TokenEvent:
    return TokenEvent(index=index, token_id=token_id, text=f"<{token_id}>")


async def _submitted(redis, prefix) -> RequestPayload:
    payload = _payload()
    await RequestStore(redis, prefix).submit(payload)
    return payload


async def _log(redis, prefix, payload) -> list:
    return [decode_event(data) for _, data in await RequestStore(redis, prefix).events(payload.id)]


async def test_a_worker_that_lost_its_request_to_a_takeover_writes_nothing_more_of_it(redis, prefix):
    payload = await _submitted(redis, prefix)
    first, second = Worker(redis, prefix, "w1"), Worker(redis, prefix, "w2")
    assert await first.take(payload) == []
    assert await first.publish(payload, _token(0, 10), _token(1, 11)) == []
    # w1 stops beating (paused): its request is put back, and w2 takes it over after index 1.
    assert await reclaim_dead_workers(redis, prefix, MODEL, 0, 3) == {"requeued": 1}
    assert await second.take(payload) == [0, 1]
    assert await second.publish(payload, _token(2, 22)) == []
    # w1 goes on: its late tokens and its end are refused, and it hears so.
    assert await first.publish(payload, _token(2, 12), _token(3, 13), end="w1's text") == [payload.id]
    assert await second.publish(payload, _token(3, 23), end="w2's text") == []
    events = await _log(redis, prefix, payload)
    assert [(e.index, e.token_id) for e in events[:-1]] == [(0, 10), (1, 11), (2, 22), (3, 23)]
    assert isinstance(events[-1], FinalEvent) and events[-1].usage.completion_tokens == 1
    record = await RequestStore(redis, prefix).record(payload.id)
    assert (record.status, record.worker, record.text) == (RequestStatus.DONE, "w2", "w2's text")


async def test_a_takeover_goes_on_after_the_last_index_not_the_count_of_log_entries(redis, prefix):
    payload = await _submitted(redis, prefix)
    first, second = Worker(redis, prefix, "w1"), Worker(redis, prefix, "w2")
    await first.take(payload)
    for _ in range(2):  # a retried publish: Redis ran the pipeline, its answer was lost
        await first.publish(payload, _token(0, 10), _token(1, 11))
    await first.publish(payload, _token(2, 12))
    assert await redis.xlen(redis_keys.token_log(prefix, payload.id)) == 5
    assert await reclaim_dead_workers(redis, prefix, MODEL, 0, 3) == {"requeued": 1}
    assert await second.take(payload) == [0, 1, 2]
    assert [e.token_id for e in second.added[-1]] == [10, 11, 12]


async def test_a_request_put_back_but_not_yet_claimed_goes_on_on_its_last_worker(redis, prefix):
    """Between the requeue and a claim its last worker's tokens are taken: whoever claims it then
    continues after them (and the worker itself, taking it back, goes on with it)."""
    payload = await _submitted(redis, prefix)
    first, second = Worker(redis, prefix, "w1"), Worker(redis, prefix, "w2")
    await first.take(payload)
    await first.publish(payload, _token(0, 10))
    assert await reclaim_dead_workers(redis, prefix, MODEL, 0, 3) == {"requeued": 1}
    assert await first.publish(payload, _token(1, 11)) == []
    assert await second.take(payload) == [0, 1]


async def test_a_publish_after_redis_lost_the_script_loads_it_again(redis, prefix):
    payload = await _submitted(redis, prefix)
    worker = Worker(redis, prefix, "w1")
    await worker.take(payload)
    await redis.script_flush()
    assert await worker.publish(payload, _token(0, 10), end="done") == []
    assert [type(e) for e in await _log(redis, prefix, payload)] == [TokenEvent, FinalEvent]


class PausingClock:
    """The lease's clock: once armed, the process stops right after its k-th read (time jumps by a
    minute, and `pause` runs meanwhile: another worker's takeover)."""

    def __init__(self, pause):
        self.now, self.pause, self.after, self.reads, self.paused = 0.0, pause, None, 0, False

    def __call__(self) -> float:
        now = self.now
        if self.after is not None and not self.paused:
            if self.reads == self.after:
                self.now, self.paused = self.now + 60.0, True
                self.pause()
            self.reads += 1
        return now


def _meanwhile(redis_url: str, prefix: str, payload: RequestPayload) -> None:
    """w1 found dead and its request taken over by w2, in another thread (w1's loop is stopped)."""
    async def takeover() -> None:
        client = Redis.from_url(redis_url, decode_responses=True)
        assert await reclaim_dead_workers(client, prefix, MODEL, 0, 3) == {"requeued": 1}
        assert await Worker(client, prefix, "w2").take(payload) == [0]
        await client.aclose()
    thread = threading.Thread(target=asyncio.run, args=(takeover(),))
    thread.start()
    thread.join()


async def _script_calls(redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_worker_paused_after_any_read_of_its_lease_clock_writes_nothing_once_taken_over(redis, redis_url):
    """The lease held when asked; the worker stops after that answer (after each read of its clock in
    turn) and another worker takes the request over before the write reaches Redis: nothing of it
    is written. Unpaused, the same publish goes out as plain commands (no script call)."""
    for after in range(20):
        prefix = f"p{uuid.uuid4().hex[:8]}"
        payload = await _submitted(redis, prefix)
        clock = PausingClock(lambda p=prefix, q=payload: _meanwhile(redis_url, p, q))
        lease = Lease(6.0, clock)
        lease.beaten(0.0, 0.0)
        first = Worker(redis, prefix, "w1", lease)
        clock.now = 1.0
        await first.take(payload)
        assert await first.publish(payload, _token(0, 10)) == []
        scripts = await _script_calls(redis)
        clock.after = after
        refused = await first.publish(payload, _token(1, 11))
        logged = [(e.index, e.token_id) for e in await _log(redis, prefix, payload)]
        if not clock.paused:  # the publish read the clock `after` times or fewer: it ran unpaused
            assert refused == [] and logged == [(0, 10), (1, 11)]
            assert await _script_calls(redis) == scripts
            assert after > 0
            return
        assert refused == [payload.id] and logged == [(0, 10)], after
    raise AssertionError("the publish read the clock 20 times")


def test_the_tokens_delivered_run_by_index_to_the_first_missing_one():
    log = [_token(0, 10), _token(1, 11), _token(0, 90), _token(1, 91), _token(2, 12), _token(4, 14)]
    assert [(e.index, e.token_id) for e in delivered_tokens(log)] == [(0, 10), (1, 11), (2, 12)]
