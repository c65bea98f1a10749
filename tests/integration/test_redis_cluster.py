"""The test Redis Cluster (tests/redis_cluster.py): three masters from Debian's redis-server on
loopback ports, keys spread over them, and a killed master's replica taking over its slots with
what was replicated to it. Groundwork for running streamq on a cluster."""
from __future__ import annotations

import redis
from redis.cluster import RedisCluster as ClusterClient

from tests.redis_cluster import RedisCluster


def test_a_three_master_cluster_spreads_keys_and_survives_a_master(tmp_path):
    cluster = RedisCluster(tmp_path, masters=3, replicas=1)
    try:
        cluster.start()
        seed = cluster.live()[0]
        with ClusterClient(host="127.0.0.1", port=seed.port, decode_responses=True) as client:
            keys = [f"k{i}" for i in range(60)]
            for key in keys:
                client.set(key, key.upper())
            assert {cluster.master_of(key).port for key in keys} == {
                n.port for n in cluster.live() if redis.Redis(port=n.port).info("replication")["role"] == "master"}
            victim = cluster.master_of("k7")
            with redis.Redis(port=victim.port) as direct:
                assert direct.wait(1, 5000) == 1  # replicated before the crash: replication is asynchronous
            assert cluster.kill_master_of("k7") is victim
        survivor = cluster.live()[0]
        with ClusterClient(host="127.0.0.1", port=survivor.port, decode_responses=True) as client:
            assert [client.get(key) for key in keys] == [key.upper() for key in keys]
            assert cluster.master_of("k7") is not victim
    finally:
        cluster.stop()
