"""The backlog limit against a real Redis: checked and applied in the script that queues, so
'replicas' submitting at once never pass it together, and a refusal leaves nothing behind."""
import asyncio
import uuid

from redis.asyncio import Redis

from api.core.backpressure import Backpressure
from api.core.errors import ApiError
from api.core.generation import Generation
from api.core.limits import Limits
from api.core.metrics import ApiMetrics
from shared.reclaim import reclaim_dead_workers
from shared import redis_keys
from shared.messages import RequestPayload
from shared.queue import RequestQueue
from shared.sampling import SamplingParams
from shared.store import RequestStore
from tests.waiting import until

LIMIT = 4


def _payload() -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[1, 2],
                          params=SamplingParams(max_tokens=2))


def _replica(redis: Redis, prefix: str) -> Generation:
    """What an api replica submits with: its Generation, with backpressure at LIMIT."""
    backpressure = Backpressure(RequestQueue(redis, prefix, "m"), LIMIT)
    return Generation(RequestStore(redis, prefix), None, None, "m", default_max_tokens=4, backpressure=backpressure)


async def _submit(replica: Generation, n: int = 1, tenant: str = "") -> bool:
    """Submit n requests together for `tenant`; whether they were queued (else 503 with Retry-After)."""
    try:
        await replica.submit([_payload() for _ in range(n)], tenant=tenant)
        return True
    except ApiError as exc:
        assert exc.status == 503 and 1 <= int(exc.headers["Retry-After"]) <= 60, exc.message
        return False


async def _records(redis: Redis, prefix: str) -> int:
    return len([k async for k in redis.scan_iter(match=redis_keys.request_record(prefix, "*"))])


async def test_two_replicas_together_never_queue_past_the_limit(redis, redis_url, prefix):
    clients = [Redis.from_url(redis_url, decode_responses=True) for _ in range(2)]  # a connection each
    try:
        replicas = [_replica(c, prefix) for c in clients]
        # Three tenants' lanes, some opened while the other replica counts the backlog.
        results = await asyncio.gather(*(_submit(replicas[i % 2], tenant=f"t{i % 3}") for i in range(60)))
    finally:
        for client in clients:
            await client.aclose()
    assert results.count(True) == LIMIT
    assert await RequestQueue(redis, prefix, "m").backlog() == (LIMIT, 0)
    assert await _records(redis, prefix) == LIMIT  # nothing written for the refused ones


async def test_a_multi_request_submit_is_all_or_none(redis, prefix):
    replica = _replica(redis, prefix)
    assert await _submit(replica, 2) and await _submit(replica, 1, tenant="acme")
    assert not await _submit(replica, 2, tenant="new-tenant")
    assert await _records(redis, prefix) == 3
    assert await redis.smembers(redis_keys.request_lanes(prefix, "m")) == {"0:-", "0:acme"}
    assert await _submit(replica, 1)
    assert not await _submit(replica, 1)


async def test_taken_requests_leave_the_backlog_and_reclaimed_ones_count_again(redis, prefix):
    replica, queue = _replica(redis, prefix), RequestQueue(redis, prefix, "m")
    assert await _submit(replica, LIMIT)
    stream = redis_keys.request_stream(prefix, "m", "0:-")
    await redis.xreadgroup(redis_keys.WORKER_GROUP, "w-dead", {stream: ">"}, count=2)  # a worker takes two
    assert await queue.backlog() == (2, 2)
    assert await _submit(replica, 1) and not await _submit(replica, 2)
    # The worker's heartbeat is gone: the scheduler puts its two back, to wait for a worker again.
    assert await reclaim_dead_workers(redis, prefix, "m", heartbeat_ttl_s=0, max_attempts=3) == {"requeued": 2}
    assert (await queue.backlog())[0] == LIMIT + 1  # over the limit by what was running, never by new ones
    assert not await _submit(replica, 1)


async def test_a_refusal_releases_what_the_tenant_limits_took(redis, prefix):
    limits = Limits(redis, prefix, 600)
    await limits.set("acme", rpm=10, tpm=1000, concurrent=10)
    replica = _replica(redis, prefix)
    replica.limits = limits
    assert await _submit(replica, LIMIT - 1, tenant="acme")
    assert not await _submit(replica, 2, tenant="acme")  # backpressure refuses, after the limits admitted
    for kind in ("rpm", "tpm", "active"):  # each request's reservation its own (tpm)
        assert await redis.zcard(redis_keys.tenant_usage(prefix, "acme", kind)) == LIMIT - 1, kind


async def test_the_sampler_shows_the_backlog_of_every_lane_on_the_queued_gauge(redis, prefix):
    """What the workers' autoscaler reads (deploy/k8s/keda): requests no worker has taken, all lanes."""
    metrics = ApiMetrics()
    queue = RequestQueue(redis, prefix, "m")
    backpressure = Backpressure(queue, LIMIT, on_backlog=metrics.queued.labels("m").set)
    replica = Generation(RequestStore(redis, prefix), None, None, "m", default_max_tokens=4, backpressure=backpressure)
    assert await _submit(replica, 2) and await _submit(replica, 1, tenant="acme")
    await redis.xreadgroup(redis_keys.WORKER_GROUP, "w", {redis_keys.request_stream(prefix, "m", "0:-"): ">"}, count=1)

    def queued() -> float | None:
        return metrics.registry.get_sample_value("streamq:num_requests_queued", {"model": "m"})

    async def shows(value: int) -> bool:
        return queued() == value
    await backpressure.start()
    try:
        await until(lambda: shows(2), what="the gauge at the backlog (2 + 1 queued, 1 taken)")
    finally:
        await backpressure.close()
