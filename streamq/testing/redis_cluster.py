"""A private Redis Cluster for tests: masters (and replicas) from Debian's redis-server, on free
loopback ports, joined by `redis-cli --cluster create`."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from shared.redis_server import RedisServer, free_port


class RedisCluster:
    """`masters` masters with `replicas` replicas each; node i is a RedisServer with cluster
    mode on. Failover is quick (node timeout `node_timeout_ms`), for the failover tests."""

    def __init__(self, folder: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000):
        self.folder, self.masters, self.replicas = folder, masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """A seed node's URL in the form every streamq process takes for a cluster."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 30.0) -> str:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is missing (Debian: redis-tools, which redis-server pulls in)")
        for i in range(self.masters * (1 + self.replicas)):
            node = RedisServer(self.folder / f"node{i}", extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms)])
            node.port = _cluster_port()
            node.start()
            self.nodes.append(node)
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
        self.wait_ok(timeout_s)
        self.wait_replicas(timeout_s)
        return self.url

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process and n.process.poll() is None]

    def wait_replicas(self, timeout_s: float = 30.0) -> None:
        """Until every master has its replicas connected and past their initial sync (WAIT counts
        only those)."""
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            roles = []
            for node in self.live():
                with redis.Redis(port=node.port, decode_responses=True) as client:
                    roles.append(client.info("replication"))
            masters = [r for r in roles if r["role"] == "master"]
            online = [all(r.get(f"slave{i}", {}).get("state") == "online" for i in range(self.replicas))
                      for r in masters]
            if len(masters) == self.masters and all(online):  # connected, and past the initial sync
                return
            time.sleep(0.1)  # polling the cluster's own state
        raise RuntimeError(f"the replicas did not connect within {timeout_s} s")

    def kill_master_of(self, key: str, timeout_s: float = 30.0) -> RedisServer:
        """SIGKILL the master that serves `key` (a crash); return once another node serves it."""
        master = self.master_of(key)
        master.kill()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.master_of(key) is not master:
                    self.wait_ok(timeout_s)
                    return master
            except (OSError, RuntimeError):
                pass
            time.sleep(0.1)  # waiting for the cluster's own failover
        raise RuntimeError(f"no replica took over {key!r}'s slot within {timeout_s} s")

    def info(self, node: RedisServer) -> dict[str, str]:
        import redis

        with redis.Redis(port=node.port, decode_responses=True) as client:
            return client.cluster("info")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says the cluster is ok (every slot served)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(self.info(n)["cluster_state"] == "ok" for n in self.live()):
                    return
            except OSError:
                pass
            time.sleep(0.1)  # polling the cluster's own state, never ordering our events
        raise RuntimeError(f"the cluster is not ok after {timeout_s} s")

    def master_of(self, key: str) -> RedisServer:
        """The node that serves `key`'s slot now."""
        import redis

        with redis.Redis(port=self.live()[0].port, decode_responses=True) as client:
            slot = client.cluster("keyslot", key)
            for start, end, master, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it, at most 65,535) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
