"""Every Lua script of shared/lua/ run by the registry (shared/scripts.py) on a real Redis and on a
Redis Cluster, with valid KEYS and ARGV, and its effect checked; and a NOSCRIPT, after SCRIPT FLUSH,
recovered without the caller seeing it. (The modules that run them have their own tests; these
check each script's contract as its header says it.)"""
from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster as AsyncCluster

from shared import redis_keys, scripts
from shared.redis_keys import EVENT_FIELD, WORKER_GROUP
from streamq.testing.redis_cluster import RedisCluster

MODEL = "m"
RID = "0b6a5a8e-0000-4000-8000-000000000001"


def run(client: Redis, name: str, keys: list, args: list):
    return scripts.register(client, name)(keys=keys, args=args)


async def _ms(client: Redis) -> int:
    """Redis's clock in ms, as the scripts read it (TIME)."""
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


async def _lane(client: Redis, prefix: str, lane: str, entries: int) -> str:
    """A lane's stream with the workers' group and `entries` entries."""
    stream = redis_keys.request_stream(prefix, MODEL, lane)
    await client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    for i in range(entries):
        await client.xadd(stream, {"payload": f"p{i}"})
    return stream


async def _record(client: Redis, prefix: str, status: str, **fields) -> list[str]:
    """A request's record with this status; its record, token log and channel keys."""
    keys = [redis_keys.request_record(prefix, RID), redis_keys.token_log(prefix, RID),
            redis_keys.request_channel(prefix, RID)]
    await client.hset(keys[0], mapping={"status": status, **fields})
    return keys


async def case_queue_backlog(client, prefix):
    lanes = redis_keys.request_lanes(prefix, MODEL)
    a, _ = await _lane(client, prefix, "0:a", 3), await _lane(client, prefix, "0:b", 1)
    await client.sadd(lanes, "0:a", "0:b")
    await client.xreadgroup(WORKER_GROUP, "w1", {a: ">"}, count=1)
    assert await run(client, "queue_backlog", [lanes], [redis_keys.request_stream(prefix, MODEL, ""), WORKER_GROUP]) \
        == [3, 1]


async def case_store_submit(client, prefix):
    lanes, doorbell = redis_keys.request_lanes(prefix, MODEL), redis_keys.lane_doorbell(prefix, MODEL)
    streams = [redis_keys.request_stream(prefix, MODEL, lane) for lane in ("0:a", "1:b")]
    stream_prefix = redis_keys.request_stream(prefix, MODEL, "")
    keys, args = [lanes, doorbell, *streams], ["0:a", "x", "1:b", "y"]
    assert await run(client, "store_submit", keys, [WORKER_GROUP, -1, stream_prefix, *args]) == [1, 0, 0]
    assert await client.smembers(lanes) == {"0:a", "1:b"}
    assert [f["lane"] for _, f in await client.xrange(doorbell)] == ["0:a", "1:b"]
    assert [f for _, f in await client.xrange(streams[0])] == [{"payload": "x"}]
    assert (await client.xinfo_groups(streams[1]))[0]["name"] == WORKER_GROUP
    # Two wait; two more would pass a limit of 3: none is queued.
    assert await run(client, "store_submit", keys, [WORKER_GROUP, 3, stream_prefix, *args]) == [0, 2, 0]
    assert await client.xlen(streams[0]) == 1 and await client.xlen(doorbell) == 2


async def case_store_claim(client, prefix):
    record, _, _ = await _record(client, prefix, "queued")
    assert await run(client, "store_claim", [record], ["w1", "12.5"]) == 1
    assert await client.hmget(record, "status", "worker", "started_at") == ["running", "w1", "12.5"]
    assert await run(client, "store_claim", [record], ["w1", "13"]) == 1  # a retried claim
    assert await run(client, "store_claim", [record], ["w2", "13"]) == 0


async def case_store_cancel(client, prefix):
    keys = await _record(client, prefix, "queued")
    assert await run(client, "store_cancel", keys, ["final", "9.5", 600]) == "queued"
    assert await client.hmget(keys[0], "status", "finish_reason", "finished_at") == ["cancelled", "cancelled", "9.5"]
    assert [f for _, f in await client.xrange(keys[1])] == [{EVENT_FIELD: "final"}]
    assert 0 < await client.ttl(keys[0]) <= 600 and 0 < await client.ttl(keys[1]) <= 600
    await client.hset(keys[0], "status", "running")
    assert await run(client, "store_cancel", keys, ["final", "9.5", 600]) == "running"
    assert await client.hget(keys[0], "cancel_requested") == "1"
    await client.delete(keys[0])
    assert await run(client, "store_cancel", keys, ["final", "9.5", 600]) is None


async def case_store_end_queued(client, prefix):
    keys = await _record(client, prefix, "queued")
    args = ["final", "9.5", 600, "waited too long", "expired", "expired"]
    assert await run(client, "store_end_queued", keys, args) == 1
    assert await client.hmget(keys[0], "status", "finish_reason", "error") == ["expired", "expired", "waited too long"]
    assert await client.xlen(keys[1]) == 1
    assert await run(client, "store_end_queued", keys, args) == 0  # no longer queued


async def case_requeue_decide(client, prefix):
    keys = await _record(client, prefix, "running", worker="w1")
    args = ["1000-1", 3, "failed", "cancelled", "9.5", 600]
    assert await run(client, "requeue_decide", keys, args) == ["requeued", 1]
    assert await client.hmget(keys[0], "status", "worker", "attempts", "requeued_from", "requeue_outcome") \
        == ["queued", "", "1", "1000-1", "requeued"]
    assert await run(client, "requeue_decide", keys, args) == ["requeued", 0]  # the same entry again
    assert await run(client, "requeue_decide", keys, ["999-5", *args[1:]]) == ["stale", 0]
    await client.hset(keys[0], mapping={"status": "running", "attempts": 2})
    assert await run(client, "requeue_decide", keys, ["1001-0", *args[1:]]) == ["dead", 1]
    assert await client.hget(keys[0], "status") == "failed"
    assert [f for _, f in await client.xrange(keys[1])] == [{EVENT_FIELD: "failed"}]


async def case_publisher_publish(client, prefix):
    keys = await _record(client, prefix, "running", worker="w1")
    end = ["end", "done", "length", 3, "9.5", "abc", 0, "", 600]
    assert await run(client, "publisher_publish", keys, ["w1", 2, "t0", "t1", "5", "", ""]) == 1
    assert [f for _, f in await client.xrange(keys[1])] == [{EVENT_FIELD: "t0"}, {EVENT_FIELD: "t1"}]
    assert await client.hmget(keys[0], "first_token_at", "scheduled_at") == ["5", None]
    assert await client.ttl(keys[0]) == -1
    # Another worker's, or one that ended: nothing written, its final event neither.
    assert await run(client, "publisher_publish", keys, ["w2", 1, "t2", "", "", *end]) == 0
    await client.hset(keys[0], "status", "failed")
    assert await run(client, "publisher_publish", keys, ["w1", 1, "t2", "", "", *end]) == 0
    assert await client.xlen(keys[1]) == 2 and await client.hget(keys[0], "status") == "failed"
    # Put back and claimed by no one yet: its last worker goes on, and its end ends it.
    await client.hset(keys[0], mapping={"status": "queued", "worker": ""})
    assert await run(client, "publisher_publish", keys, ["w1", 1, "t2", "", "", *end]) == 1
    assert [f[EVENT_FIELD] for _, f in await client.xrange(keys[1])] == ["t0", "t1", "t2", "end"]
    assert await client.hmget(keys[0], "status", "finish_reason", "completion_tokens", "finished_at", "text",
                              "reused_tokens", "error") == ["done", "length", "3", "9.5", "abc", "0", None]
    assert 0 < await client.ttl(keys[0]) <= 600 and 0 < await client.ttl(keys[1]) <= 600


async def case_requeue_release(client, prefix):
    stream = await _lane(client, prefix, "0:a", 1)
    [[_, [(entry_id, _)]]] = await client.xreadgroup(WORKER_GROUP, redis_keys.RECLAIMER, {stream: ">"})
    assert await run(client, "requeue_release", [stream], [WORKER_GROUP, entry_id, "requeued", "again"]) == 1
    assert (await client.xpending(stream, WORKER_GROUP))["pending"] == 0
    assert [f for _, f in await client.xrange(stream)] == [{"payload": "p0"}, {"payload": "again"}]
    assert await run(client, "requeue_release", [stream], [WORKER_GROUP, entry_id, "requeued", "again"]) == 0
    assert await client.xlen(stream) == 2


async def case_affinity_announce(client, prefix):
    holders, expiry = redis_keys.prefix_holders(prefix, MODEL), redis_keys.prefix_expiry(prefix, MODEL)
    await client.hset(holders, "gone", "1:w0")  # expired long ago
    await client.zadd(expiry, {"gone": 1})
    before = await _ms(client)
    assert await run(client, "affinity_announce", [holders, expiry], ["w1", 60_000, 4, "h1", "h2"]) == 1
    until, worker = (await client.hget(holders, "h1")).split(":")
    assert worker == "w1" and before + 60_000 <= int(until) <= await _ms(client) + 60_000
    assert set(await client.hkeys(holders)) == {"h1", "h2"} and await client.zcard(expiry) == 2
    await run(client, "affinity_announce", [holders, expiry], ["w2", 60_000, 4, "h1"])
    assert [h.split(":")[1] for h in (await client.hget(holders, "h1")).split("/")] == ["w2", "w1"]


async def case_affinity_lookup(client, prefix):
    holders, free = redis_keys.prefix_holders(prefix, MODEL), redis_keys.worker_free_slots(prefix, MODEL)
    later = await _ms(client) + 60_000
    await client.hset(holders, "h1", f"{later}:w1/{later}:w2/1:w3")  # w3's announcement has expired
    await client.hset(free, mapping={"w1": f"1:{later}", "w2": f"5:{later}"})
    assert await run(client, "affinity_lookup", [holders, free], ["h1", "h9"]) == [["w2", "w1"], []]


async def case_limits_charge(client, prefix):
    keys = [redis_keys.tenant_limits(prefix, "acme")] + \
           [redis_keys.tenant_usage(prefix, "acme", kind) for kind in ("rpm", "tpm", "active")]
    await client.hset(keys[0], mapping={"rpm": 2, "weight": 3})
    now = time.time()
    assert await run(client, "limits_charge", keys, [now, "r1 r2", 10, "", 600]) == [0, "3"]
    assert await client.zrange(keys[1], 0, -1) == ["r1", "r2"] and await client.zrange(keys[2], 0, -1) == ["r1:10"]
    assert await client.zcard(keys[3]) == 2
    kind, wait = await run(client, "limits_charge", keys, [now + 1, "r3", 10, "", 600])
    assert kind == "requests per minute" and 1 <= int(wait) <= 60
    assert await client.zcard(keys[1]) == 2


async def case_batch_result(client, prefix):
    results, record = redis_keys.batch_results(prefix, "b1"), redis_keys.batch_record(prefix, "b1")
    for _ in range(2):  # a job run again finds the result written
        assert await run(client, "batch_result", [results, record], ["c1", '{"ok": 1}', "completed"]) is None
    assert await client.hgetall(results) == {"c1": '{"ok": 1}'} and await client.hget(record, "completed") == "1"


async def case_intake_take(client, prefix):
    free = redis_keys.worker_free_slots(prefix, MODEL)
    stream = await _lane(client, prefix, "0:a", 2)
    args = [WORKER_GROUP, "w1", 4, 1, 1000, 0, "a", "1", ""]
    reply = await run(client, "intake_take", [free, stream], args)
    assert reply[0] == 2 and reply[1] == [] and [(i, f) for i, _, f in reply[2:]] == [(1, ["payload", "p0"]),
                                                                                     (1, ["payload", "p1"])]
    assert (await client.hget(free, "w1")).split(":")[0] == "2"
    assert (await client.xpending(stream, WORKER_GROUP))["pending"] == 2
    last = (await client.xrevrange(stream, count=1))[0][0]
    assert await run(client, "intake_take", [free, stream], args) == [0, [], [last], -1]  # nothing left


async def case_intake_drop(client, prefix):
    free, lanes = redis_keys.worker_free_slots(prefix, MODEL), redis_keys.request_lanes(prefix, MODEL)
    gone, kept = "^w9/0:a", "^w1/0:a"
    streams = [await _lane(client, prefix, gone, 0), await _lane(client, prefix, kept, 0)]
    await client.sadd(lanes, gone, kept)
    await client.hset(free, "w1", f"2:{await _ms(client) + 60_000}")  # w1 reads still; w9 announces nothing
    dropped = await run(client, "intake_drop", [free, lanes, *streams], [WORKER_GROUP, gone, "w9", kept, "w1"])
    assert dropped == [streams[0]]
    assert await client.smembers(lanes) == {kept} and await client.exists(*streams) == 1


async def case_streams_take(client, prefix):
    key = redis_keys.tenant_streams(prefix, "acme")
    await client.zadd(key, {"lapsed": 1})  # a dead replica's slot, its lease long over
    assert [await run(client, "streams_take", [key], [s, 2, 60_000]) for s in ("s1", "s2", "s3")] == [1, 1, 0]
    assert sorted(await client.zrange(key, 0, -1)) == ["s1", "s2"]
    pttl, last = await client.pttl(key), (await client.zrange(key, -1, -1, withscores=True))[0][1]
    assert 0 < pttl <= 60_000 and abs(await _ms(client) + pttl - last) < 1000  # the set goes with its last lease


async def case_streams_renew(client, prefix):
    key = redis_keys.tenant_streams(prefix, "acme")
    await client.zadd(key, {"s1": await _ms(client) + 1000})
    await client.pexpire(key, 1000)
    assert await run(client, "streams_renew", [key], [60_000, "s1", "freed"]) == 1
    assert await client.zrange(key, 0, -1) == ["s1"]  # a freed slot is not brought back
    assert 1000 < await client.pttl(key) <= 60_000
    assert await run(client, "streams_renew", [redis_keys.tenant_streams(prefix, "none")], [60_000, "s1"]) == 0
    assert not await client.exists(redis_keys.tenant_streams(prefix, "none"))


CASES = {name.removeprefix("case_"): case for name, case in globals().items() if name.startswith("case_")}


def test_every_script_has_a_case():
    assert set(CASES) == {n for n in scripts.names() if not scripts.is_library(n)}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_each_script_does_what_its_header_says(redis, prefix, name):
    await CASES[name](redis, prefix)


async def test_a_script_flushed_from_redis_is_loaded_again_without_the_caller_seeing_it(redis, prefix):
    await case_store_claim(redis, prefix)
    claim = scripts.register(redis, "store_claim")
    assert await redis.script_exists(claim.sha) == [True]
    await redis.script_flush()
    assert await redis.script_exists(claim.sha) == [False]
    record, _, _ = await _record(redis, prefix, "queued")
    assert await claim(keys=[record], args=["w3", "1"]) == 1  # NOSCRIPT, SCRIPT LOAD, EVALSHA
    assert await redis.script_exists(claim.sha) == [True]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = RedisCluster(tmp_path_factory.mktemp("cluster"), masters=3)
    running.start()
    yield running
    running.stop()


@pytest.fixture
async def cluster_client(cluster):
    client = AsyncCluster(host="127.0.0.1", port=cluster.live()[0].port, decode_responses=True)
    yield client
    await client.aclose()


@pytest.mark.parametrize("name", sorted(CASES))
async def test_each_script_runs_on_a_cluster(cluster_client, prefix, name):
    """Every key a script touches lies in its KEYS' slot: a script that read a key of another slot
    would fail here (its slot lives on another master, or CROSSSLOT)."""
    await CASES[name](cluster_client, prefix)


async def test_a_flushed_script_is_loaded_again_on_a_cluster(cluster_client, prefix):
    """On a cluster the reload reaches the master of the script's slot too (SCRIPT LOAD goes to every master)."""
    take = scripts.register(cluster_client, "intake_take")
    await case_intake_take(cluster_client, prefix)
    await cluster_client.script_flush()
    assert await cluster_client.script_exists(take.sha) == [False]
    await case_intake_take(cluster_client, f"{prefix}b")
    assert await cluster_client.script_exists(take.sha) == [True]
