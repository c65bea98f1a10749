"""The redis-server `streamq serve` (`make run`) starts: its memory capped with noeviction, its
append-only file in the state folder so a restart keeps what was queued, one serve per folder."""
import pytest
from redis import Redis

from shared.settings import ServeSettings
from streamq.serve import private_redis


def test_a_restart_keeps_queued_entries_and_the_limit_holds(tmp_path):
    settings = ServeSettings(_env_file=None, state_dir=tmp_path / "state", redis_maxmemory_mb=100)
    redis = private_redis(settings)
    url = redis.start()
    try:
        with Redis.from_url(url, decode_responses=True) as client:
            assert client.config_get("maxmemory")["maxmemory"] == str(100 * 2**20)
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
            assert client.config_get("appendonly")["appendonly"] == "yes"
            entry = client.xadd("streamq:queue", {"payload": "a request"})
        redis.stop()  # as Ctrl-C stops it; the next start reads its append-only file
        url = redis.start()
        with Redis.from_url(url, decode_responses=True) as client:
            assert client.xrange("streamq:queue") == [(entry, {"payload": "a request"})]
    finally:
        redis.stop()
    assert redis.folder == tmp_path / "state" / "redis"


def test_a_second_serve_on_the_same_folder_is_refused(tmp_path):
    settings = ServeSettings(_env_file=None, state_dir=tmp_path / "state")
    private_redis(settings)  # this process now holds the folder
    with pytest.raises(RuntimeError, match="another `streamq serve`"):
        # flock is per open file: a second open of the lock in this process is refused as another's would be
        private_redis(settings)

