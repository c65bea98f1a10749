"""arq on a Redis Cluster (shared/arq_cluster.py): every key arq touches shares one slot, the
cluster URL's seeds and options, and which errors mean arq's slot moved."""
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared import redis_keys
from shared.arq_cluster import parse_cluster_url, slot_lost


def _slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_arq_key_of_a_batch_and_a_cron_job_is_in_the_slot_of_arqs_abort_set():
    """arq's finishing MULTI touches the job's keys, the queue and the fixed key `arq:abort`
    (arq/worker.py finish_job, even with aborts off): all must share one slot."""
    queue = redis_keys.arq_queue("p")
    jobs = [redis_keys.arq_job_id("p", "batch_0f3a"), f"{redis_keys.arq_job_id('p', 'cron:trim')}:1700000000123"]
    keys = [queue, f"{queue}:health-check", "arq:abort"] + [
        f"arq:{kind}:{job}" for job in jobs for kind in ("job", "in-progress", "result", "retry")]
    assert {_slot(k) for k in keys} == {_slot("arq:abort")}
    assert redis_keys.arq_queue("p") != redis_keys.arq_queue("q")
    assert redis_keys.arq_job_id("p", "cron:trim") != redis_keys.arq_job_id("q", "cron:trim")


def test_a_cluster_url_gives_its_seeds_and_each_nodes_url():
    url = parse_cluster_url("rediss+cluster://app:p%40ss@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?ssl_ca_certs=/ca.pem")
    assert url.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)) and url.tls
    assert url.node_url("10.0.0.9", 7005) == "rediss://app:p%40ss@10.0.0.9:7005/0?ssl_ca_certs=/ca.pem"
    assert url.node_url("::1", 7002) == "rediss://app:p%40ss@[::1]:7002/0?ssl_ca_certs=/ca.pem"
    plain = parse_cluster_url("redis+cluster://127.0.0.1:7000")
    assert plain.nodes == (("127.0.0.1", 7000),) and not plain.tls
    assert plain.node_url("127.0.0.1", 7000) == "redis://127.0.0.1:7000/0"
    assert parse_cluster_url("redis://127.0.0.1:6379/0") is None and parse_cluster_url("unix:///tmp/r.sock") is None


def test_what_counts_as_the_slot_lost():
    assert slot_lost(RedisConnectionError("Connection closed by server."))
    assert slot_lost(ResponseError("MOVED 6503 127.0.0.1:7001"))
    assert slot_lost(ResponseError("Command # 2 (ZREM arq:abort x) of pipeline caused error: MOVED 6503 10.0.0.2:7001"))
    assert slot_lost(ResponseError("CLUSTERDOWN The cluster is down"))
    assert not slot_lost(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
