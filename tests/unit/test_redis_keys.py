import re

from shared import redis_keys

RID = "0b9f6a2e-8f3c-4c55-9d8e-2f7f3c1e2a10"


def _hash_tag(key: str) -> str:
    match = re.search(r"\{([^}]*)\}", key)
    assert match, key
    return match.group(1)


def test_request_keys_share_one_hash_slot():
    names = [redis_keys.request_record("p", RID), redis_keys.token_log("p", RID), redis_keys.request_channel("p", RID)]
    assert {_hash_tag(n) for n in names} == {RID}
    assert len(set(names)) == 3


def test_every_key_starts_with_the_prefix():
    names = [redis_keys.request_stream("pre", "m", "0:a"), redis_keys.request_lanes("pre", "m"), redis_keys.lane_doorbell("pre", "m"),
             redis_keys.request_record("pre", RID), redis_keys.token_log("pre", RID),
             redis_keys.request_channel("pre", RID), redis_keys.cancel_channel("pre"), redis_keys.worker_heartbeat("pre", "w"),
             redis_keys.replica_channel("pre", "r"), redis_keys.dead_letter_stream("pre")]
    assert all(n.startswith("pre:") for n in names)
    assert len(set(names)) == len(names)


def test_request_stream_is_per_model_and_lane():
    streams = {redis_keys.request_stream("p", m, lane) for m in ("a", "b") for lane in ("0:x", "0:y", "1:x")}
    assert len(streams) == 6


def test_heartbeat_pattern_matches_heartbeats():
    pattern = redis_keys.worker_heartbeat_pattern("p").replace("*", ".*")
    assert re.fullmatch(pattern, redis_keys.worker_heartbeat("p", "host-1"))


def test_prefix_announcements_share_the_models_slot():
    names = [redis_keys.prefix_holders("p", "m"), redis_keys.prefix_expiry("p", "m")]
    assert {_hash_tag(n) for n in names} == {"m"} and len(set(names)) == 2
