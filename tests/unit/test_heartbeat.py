"""The heartbeat (shared/heartbeat.py): its keys on the wire, its version, and how its readers
(shared/workers.py, the api's, prefix routing) handle one they cannot read."""
from __future__ import annotations

import json
import logging

import fakeredis
import pytest
from pydantic import ValidationError

from shared import redis_keys
from shared.heartbeat import Heartbeat
from shared.messages import UnknownVersion
from shared.workers import live_workers

# The keys a worker's heartbeat had before it carried a version: readers of that version read these.
EARLIER_KEYS = {"worker", "model", "backend", "capacity", "running", "waiting", "metrics_port", "deterministic",
                "batch_invariant", "pools", "lora", "adapters", "plan", "kv_blocks_free", "kv_blocks_total", "at",
                "generated_tokens", "ttft_sum_s", "ttft_count"}


def _beat(**more) -> Heartbeat:
    values = dict(worker="w1", model="m", backend="hf", capacity=8, running=2, waiting=1, metrics_port=9100,
                  deterministic=False, batch_invariant=True, pools=True, lora=True, adapters=["sql"],
                  plan={"engine": "paged", "forward": "llama-kernels"}, kv_blocks_free=90, kv_blocks_total=100,
                  at=1712000000.5, generated_tokens=40, ttft_sum_s=1.25, ttft_count=4)
    return Heartbeat(**{**values, **more})


def test_a_heartbeat_round_trips_with_the_keys_it_always_had_and_a_version():
    beat = _beat()
    wire = json.loads(beat.encode())
    assert set(wire) == EARLIER_KEYS | {"version"} and wire["version"] == 1
    assert Heartbeat.decode(beat.encode()) == beat
    assert beat.wire() == wire


def test_a_backend_without_kv_blocks_leaves_their_keys_out():
    beat = _beat(kv_blocks_free=None, kv_blocks_total=None, metrics_port=None)
    wire = json.loads(beat.encode())
    assert "kv_blocks_free" not in wire and "kv_blocks_total" not in wire
    assert wire["metrics_port"] is None  # null, as before
    assert Heartbeat.decode(beat.encode()) == beat


def test_a_heartbeat_written_before_versions_reads_as_version_1():
    earlier = {k: v for k, v in json.loads(_beat().encode()).items() if k != "version"}
    assert Heartbeat.decode(json.dumps(earlier)) == _beat()


def test_an_unknown_version_is_refused_by_name_and_a_malformed_beat_by_its_field():
    newer = json.dumps({**json.loads(_beat().encode()), "version": 2})
    with pytest.raises(UnknownVersion, match="Heartbeat version 2: this process reads version 1"):
        Heartbeat.decode(newer)
    with pytest.raises(ValidationError, match="capacity"):
        Heartbeat.decode(json.dumps({**json.loads(_beat().encode()), "capacity": -1}))


async def test_the_live_workers_leave_out_a_beat_they_cannot_read_and_say_which(caplog):
    redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    await redis.set(redis_keys.worker_heartbeat("p", "w1"), _beat().encode())
    await redis.set(redis_keys.worker_heartbeat("p", "w2"),
                    json.dumps({**json.loads(_beat(worker="w2").encode()), "version": 2}))
    with caplog.at_level(logging.WARNING, logger="shared.workers"):
        live = await live_workers(redis, "p")
    assert live == [_beat()]
    assert "p:worker:w2" in caplog.text and "Heartbeat version 2" in caplog.text
