"""The test Redis Cluster (streamq/testing/redis_cluster.py): three masters from Debian's redis-server on
loopback ports, keys spread over them, and a killed master's replica taking over its slots with
what was replicated to it. Groundwork for running streamq on a cluster."""
from __future__ import annotations

import redis
from redis.cluster import RedisCluster as ClusterClient

from streamq.testing.redis_cluster import RedisCluster
from tests.waiting import until_sync


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
            with redis.Redis(port=victim.port, decode_responses=True) as direct:
                # Replicated before the crash (replication is asynchronous): the replica's offset has
                # reached the master's. A WAIT on this connection would wait for nothing: it wrote nothing.
                written = direct.info("replication")["master_repl_offset"]
                until_sync(lambda: direct.info("replication")["slave0"]["offset"] >= written, 30,
                           "the replica of k7's master caught up")
            assert cluster.kill_master_of("k7") is victim
        survivor = cluster.live()[0]
        with ClusterClient(host="127.0.0.1", port=survivor.port, decode_responses=True) as client:
            assert [client.get(key) for key in keys] == [key.upper() for key in keys]
            assert cluster.master_of("k7") is not victim
    finally:
        cluster.stop()


async def test_the_tenant_limits_script_runs_on_a_cluster(tmp_path):
    """api/core/limits.py's charge touches only the tenant's keys (one hash tag, one slot): it runs
    on a cluster, where a script reading a key it is not given fails (CROSSSLOT)."""
    import pytest
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    from api.core.errors import ApiError
    from api.core.limits import Limits
    from shared import redis_keys
    from shared.messages import RequestStatus
    from shared.request_record import RecordField

    cluster = RedisCluster(tmp_path, masters=3)
    try:
        cluster.start()
        client = AsyncCluster(host="127.0.0.1", port=cluster.live()[0].port, decode_responses=True)
        try:
            limits = Limits(client, "c", 600)
            await limits.set("acme", concurrent=2)
            ids = ["0b6a5a8e-0000-4000-8000-00000000000" + str(i) for i in range(4)]
            for rid in ids[:2]:
                await limits.charge("acme", [rid], 1)
                await client.hset(redis_keys.request_record("c", rid), RecordField.STATUS, RequestStatus.RUNNING)
            assert len({client.keyslot(redis_keys.request_record("c", rid)) for rid in ids}) > 1  # records spread
            with pytest.raises(ApiError, match="concurrent"):
                await limits.charge("acme", [ids[2]], 1)
            await client.hset(redis_keys.request_record("c", ids[0]), RecordField.STATUS, RequestStatus.DONE)
            await limits.charge("acme", [ids[3]], 1)  # the ended request freed its slot
        finally:
            await client.aclose()
    finally:
        cluster.stop()


def test_the_worker_and_the_api_refuse_a_cluster_node_at_start(tmp_path, tiny_llama):
    """A cluster node given as a plain redis:// URL is refused at start with the form to use, not
    met with MOVED errors on half the keys later."""
    import os
    import subprocess
    import sys

    from shared.redis_server import free_port
    from tests.stack import ROOT

    cluster = RedisCluster(tmp_path / "cluster", masters=3)
    try:
        cluster.start()
        env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{cluster.live()[0].port}/0", "STREAMQ_BACKEND": "null",
               "STREAMQ_MODEL": str(tiny_llama), "STREAMQ_MODEL_CACHE_DIR": str(tmp_path / "cache"),
               "STREAMQ_METRICS_PORT": "-1", "STREAMQ_PORT": str(free_port())}
        for process in ("worker", "api"):
            run = subprocess.run([sys.executable, "-m", "streamq.cli", process], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode != 0 and "give the cluster as redis+cluster://" in run.stdout + run.stderr, process
    finally:
        cluster.stop()
