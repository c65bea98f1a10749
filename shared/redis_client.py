"""The Redis client every process uses.

redis-py's asyncio connection packs commands in pure Python (about 7.5 µs for a token's XADD);
hiredis packs the same bytes in under 1 µs. A worker publishing a batch of 1,000 streams sends
2,000 commands per step, so the packing is done by hiredis when it is installed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote, urlparse, urlsplit

from arq.connections import RedisSettings
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ClusterDownError, TryAgainError
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


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlparse(url).scheme in CLUSTER_SCHEMES


def connect(url: str) -> Redis:
    """A client for `url` (redis://, rediss:// with TLS, unix://), answers decoded as str.

    `redis+cluster://[user:password@]host:port[,host:port...][?options]` (`rediss+cluster://`
    with TLS) is a Redis Cluster given by one or more of its nodes: the client learns the rest,
    routes each command to the master of its key's slot, and follows failovers.

    The URL's query options (ssl_ca_certs, ssl_cert_reqs, ...) and its percent-encoded password
    are honoured as redis-py reads them; only the connection class is ours (hiredis packing)."""
    if is_cluster_url(url):
        return _connect_cluster(url)
    options = parse_url(url)
    scheme = urlparse(url).scheme
    if hiredis is not None and scheme in _CLASSES:
        options["connection_class"] = _CLASSES[scheme]
    return Redis.from_pool(ConnectionPool(decode_responses=True, **options))


@dataclass(frozen=True)
class ClusterUrl:
    """`redis+cluster://[user:pass@]host:port[,host:port...][?query]` (rediss+cluster: TLS)."""
    nodes: tuple[tuple[str, int], ...]  # the seeds, in the URL's order
    tls: bool
    userinfo: str  # "user:pass@" as written (percent-encoded), or ""
    query: str  # the options every node's connection takes (ssl_ca_certs=...), or ""

    def node_url(self, host: str, port: int) -> str:
        """The URL of one node, as a single Redis (database 0: a cluster has no other)."""
        address = f"[{host}]" if ":" in host else host
        query = f"?{self.query}" if self.query else ""
        return f"{'rediss' if self.tls else 'redis'}://{self.userinfo}{address}:{port}/0{query}"


def parse_cluster_url(url: str) -> ClusterUrl | None:
    """The seeds and options of a cluster URL, as written; None for any other URL (one Redis)."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        return None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{unquote(address)!r} in the cluster URL is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return ClusterUrl(tuple(nodes), CLUSTER_SCHEMES[parts.scheme] == "rediss", f"{userinfo}@" if userinfo else "",
                      parts.query)


def cluster_nodes(url: str) -> list[dict]:
    """The connection options of each node a redis+cluster:// URL names, as parse_url gives them."""
    cluster = parse_cluster_url(url)
    return [parse_url(cluster.node_url(host, port)) for host, port in cluster.nodes]


def _connect_cluster(url: str) -> RedisCluster:
    nodes = cluster_nodes(url)
    options = {k: v for k, v in nodes[0].items() if k not in ("host", "port", "db", "connection_class")}
    if int(nodes[0].get("db", 0)):
        raise ValueError("a Redis Cluster has database 0 only; drop the /N from REDIS_URL")
    tls = urlparse(url).scheme == "rediss+cluster"
    client = RedisCluster(startup_nodes=[ClusterNode(n.get("host", "localhost"), int(n.get("port", 6379)))
                                         for n in nodes], decode_responses=True, ssl=tls, **options)
    # redis-py iterates the seeds (awaiting each) while refreshing its map of the slots, and a command
    # that loses its node's connection meanwhile removes that node from them: "dictionary changed size
    # during iteration" killed a worker when a master died. Each iteration takes a snapshot instead.
    client.nodes_manager.startup_nodes = _SnapshotDict(client.nodes_manager.startup_nodes)
    if hiredis is not None:  # RedisCluster takes no connection class: set ours where it builds nodes from
        fast = FastSSLConnection if tls else FastConnection
        client.connection_kwargs["connection_class"] = fast
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = fast
    return client


def connect_blocking(url: str, timeout_s: float):
    """A blocking client for `url` (any URL connect takes), answers as bytes, each command given
    up after `timeout_s`: for a thread that must not wait on a slow Redis (the worker's model
    thread, through worker/engine/kv_tier.py)."""
    import redis
    import redis.cluster
    from redis.connection import parse_url as parse_blocking_url

    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **timeouts)
    cluster = parse_cluster_url(url)
    nodes = [parse_blocking_url(cluster.node_url(host, port)) for host, port in cluster.nodes]
    options = {k: v for k, v in nodes[0].items() if k not in ("host", "port", "db", "connection_class")}
    return redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(n.get("host", "localhost"), int(n.get("port", 6379))) for n in nodes],
        ssl=cluster.tls, **options, **timeouts)


class _SnapshotDict(dict):
    """A dict whose values() is a list taken now: safe to iterate while others change the dict."""

    def values(self):
        return list(super().values())


def is_cluster(redis: Redis | RedisCluster) -> bool:
    return isinstance(redis, RedisCluster)


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


# BusyLoadingError (AOF replay) is a ConnectionError. On a cluster, while a replica takes over a lost
# master's slots, the nodes answer CLUSTERDOWN (or TRYAGAIN in a slot's migration): Redis is away too.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError)
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
    """REDIS_URL points at a node of a Redis Cluster through a plain redis:// URL."""


async def refuse_cluster(redis: Redis | RedisCluster) -> None:
    """Say at start that a cluster node given as a plain redis:// URL must be given as
    redis+cluster://, rather than fail later with MOVED errors on other nodes' keys."""
    if is_cluster(redis):
        return
    if int((await redis.info("cluster")).get("cluster_enabled", 0)) == 1:
        raise ClusterUnsupported("REDIS_URL points at a Redis Cluster node through redis://; give the cluster as "
                                 "redis+cluster://host:port (rediss+cluster:// with TLS), see docs/scaling.md")
