"""The fleet gauges an api replica reads from Redis at each scrape (ApiMetrics.sample_fleet): the
ready workers by model and the dead letters, which the alerts in deploy/prometheus watch."""

from api.core.metrics import ApiMetrics
from shared import redis_keys
from shared.heartbeat import Heartbeat


async def _beat(redis, prefix: str, worker: str, model: str, ttl_ms: int = 60_000) -> None:
    beat = Heartbeat(worker=worker, model=model, backend="null", capacity=1, running=0, waiting=0, metrics_port=None,
                     deterministic=False, batch_invariant=False, pools=False, lora=False, adapters=[], plan={},
                     at=0.0, generated_tokens=0, ttft_sum_s=0.0, ttft_count=0)
    await redis.set(redis_keys.worker_heartbeat(prefix, worker), beat.encode(), px=ttl_ms)


async def test_ready_workers_are_counted_by_model_and_a_model_left_without_any_reads_zero(redis, prefix):
    metrics = ApiMetrics()

    def ready(model: str) -> float | None:
        return metrics.registry.get_sample_value("streamq:num_workers_ready", {"model": model})

    await metrics.sample_fleet(redis, prefix, "m")
    assert ready("m") == 0  # the replica's own model, before any worker
    await _beat(redis, prefix, "w1", "m")
    await _beat(redis, prefix, "w2", "m")
    await _beat(redis, prefix, "w3", "other")
    await _beat(redis, "another-deployment", "w4", "m")
    await metrics.sample_fleet(redis, prefix, "m")
    assert (ready("m"), ready("other")) == (2, 1)
    await redis.delete(redis_keys.worker_heartbeat(prefix, "w3"))  # its heartbeat expired
    await metrics.sample_fleet(redis, prefix, "m")
    assert (ready("m"), ready("other")) == (2, 0)


async def test_dead_letters_count_every_entry_ever_added(redis, prefix):
    metrics = ApiMetrics()

    def dead() -> float | None:
        return metrics.registry.get_sample_value("streamq:dead_letter_requests")

    await metrics.sample_fleet(redis, prefix, "m")
    assert dead() == 0  # no stream yet
    stream = redis_keys.dead_letter_stream(prefix)
    first = await redis.xadd(stream, {"id": "a", "reason": "r"})
    await redis.xadd(stream, {"id": "b", "reason": "r"})
    await redis.xdel(stream, first)  # an operator cleared one: it was still dead-lettered
    await metrics.sample_fleet(redis, prefix, "m")
    assert dead() == 2
