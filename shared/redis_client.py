"""The Redis client every process uses.

redis-py's asyncio connection packs commands in pure Python (about 7.5 µs for a token's XADD);
hiredis packs the same bytes in under 1 µs. A worker publishing a batch of 1,000 streams sends
2,000 commands per step, so the packing is done by hiredis when it is installed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlparse

from arq.connections import RedisSettings
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis comes with redis[hiredis]
    hiredis = None

T = TypeVar("T")


class _HiredisPacking:
    def pack_command(self, *args):
        if isinstance(args[0], str) and " " in args[0]:  # e.g. "CLIENT SETNAME": words go separately
            args = tuple(args[0].split()) + args[1:]
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a type hiredis does not pack (memoryview): the generic path
            return super().pack_command(*args)


class FastConnection(_HiredisPacking, Connection):
    pass


class FastSSLConnection(_HiredisPacking, SSLConnection):
    pass


class FastUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    pass


_CLASSES = {"redis": FastConnection, "rediss": FastSSLConnection, "unix": FastUnixConnection}


def connect(url: str) -> Redis:
    """A client for `url` (redis://, rediss:// with TLS, unix://), answers decoded as str.

    The URL's query options (ssl_ca_certs, ssl_cert_reqs, ...) and its percent-encoded password
    are honoured as redis-py reads them; only the connection class is ours (hiredis packing)."""
    options = parse_url(url)
    scheme = urlparse(url).scheme
    if hiredis is not None and scheme in _CLASSES:
        options["connection_class"] = _CLASSES[scheme]
    return Redis.from_pool(ConnectionPool(decode_responses=True, **options))


def arq_settings(url: str) -> RedisSettings:
    """arq's settings for the same URL. (arq's own from_dsn drops the query options, so a CA
    given as ?ssl_ca_certs= would be ignored, and it does not decode the password.)"""
    options = parse_url(url)
    if urlparse(url).scheme == "unix":
        return RedisSettings(unix_socket_path=options["path"], database=int(options.get("db", 0)),
                             username=options.get("username"), password=options.get("password"))
    ssl = {k: v for k, v in options.items() if k in _ARQ_SSL_OPTIONS}
    if "ssl_check_hostname" in ssl:
        ssl["ssl_check_hostname"] = str(ssl["ssl_check_hostname"]).lower() in ("1", "true", "yes")
    return RedisSettings(host=options.get("host", "localhost"), port=int(options.get("port", 6379)),
                         database=int(options.get("db", 0)), username=options.get("username"),
                         password=options.get("password"), ssl=urlparse(url).scheme == "rediss", **ssl)


_ARQ_SSL_OPTIONS = {"ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data", "ssl_check_hostname"}


REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)  # BusyLoadingError (AOF replay) is a ConnectionError
BACKOFF = ExponentialBackoff(cap=5.0, base=0.05)  # 0.1, 0.2, 0.4 ... 5 s between tries (it keeps no state)


async def until_redis_answers(what: str, call: Callable[[], Awaitable[T]], log: logging.Logger,
                              give_up_after_s: float | None = None,
                              give_up: Callable[[], bool] | None = None) -> T:
    """Run a Redis call until Redis answers, backing off from 0.1 to 5 s (a Redis restart).

    The last error is raised once `give_up_after_s` has passed, or when `give_up()` says so
    after a failure (e.g. the process is stopping).
    """
    # redis-py's Retry runs the loop and the backoff; ours is only its failure hook, which gives
    # up on a clock or when the process stops (Retry counts tries only). Not the client's retry=
    # option: that would repeat every command of the process (the api's XADD of a request too,
    # and its 503 would wait), where each caller here repeats one unit that is safe to repeat.
    started, failures = time.monotonic(), 0

    async def failed(exc: Exception) -> None:
        nonlocal failures
        failures += 1
        delay = BACKOFF.compute(failures)
        if give_up_after_s is not None and time.monotonic() - started + delay > give_up_after_s:
            raise exc
        if give_up is not None and give_up():
            raise exc
        log.warning("redis unavailable during %s (%s); retrying in %.1f s", what, exc, delay)

    return await Retry(BACKOFF, retries=-1, supported_errors=REDIS_DOWN).call_with_retry(call, failed)


class ClusterUnsupported(RuntimeError):
    """REDIS_URL points at a node of a Redis Cluster, which streamq does not run on yet."""


async def refuse_cluster(redis: Redis) -> None:
    """Say at start that a Redis Cluster node is not a Redis streamq can use, rather than fail
    later with MOVED errors on every key of another node's slots (docs/scaling.md)."""
    if int((await redis.info("cluster")).get("cluster_enabled", 0)) == 1:
        raise ClusterUnsupported("REDIS_URL points at a Redis Cluster node; streamq does not run on Redis Cluster "
                                 "yet (docs/scaling.md, 'Not done yet'): use one Redis, with replicas for failover")
