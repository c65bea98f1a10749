"""The shared KV tier: full KV-cache blocks kept in Redis for every worker of a model.

A worker offloads each full block its steps compute (worker/engine/block_manager.py lists them), keyed
by the stable hash of its tokens' chain within a *space* that names the model and how it
computes (weights, dtype, quantization, the kernels' ISA): only workers that would compute the
same bits share. A worker whose own prefix cache misses fetches the blocks that follow from the
tier before the request's first step. So a prefix computed once by any worker is reused by all,
the next turn of a chat may land on any worker, and a takeover after a crash recomputes only
the last, partial block of what the dead worker had computed.

The tier never changes a result and never fails a request: a block found is the block a worker
computed for the same tokens; one missing, slow or broken is a miss, and the prefix is computed
as without the tier. Offloading runs on its own thread; the model thread only copies a block
out (and drops it where that thread is behind). After a Redis error the tier rests for
AWAY_S, every fetch a miss meanwhile. Memory is bounded: a block lives `ttl_s` from its last
use, and a space holds at most `budget_bytes` of blocks (checked every TRIM_EVERY_S), the
least recently used evicted first.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from shared import redis_keys
from worker.engine.block_manager import ChainBlock

log = logging.getLogger("streamq.kv_tier")

# A stored block: this header, the block's tokens (int64) and its parent's hash (16 bytes, or
# zeros for the first block), then the keys and values as the worker's cache holds them. The
# tokens and parent are checked on fetch: a block is used only for the very tokens it was made of.
MAGIC = b"SQKV1"
_HEADER = struct.Struct("<5sBH")  # magic, has a parent, tokens
AWAY_S = 5.0  # how long the tier rests after a Redis error
TRIM_EVERY_S = 1.0
WRITE_BATCH = 32  # blocks per pipeline of the writer thread
ERROR_LOG_EVERY_S = 30.0
SAMPLE = 1 << 20  # bytes read from each end of a weights file for its fingerprint
WEIGHT_FILES = ("*.gguf", "*.safetensors", "*.bin", "*.pt", "config.json")


def weights_fingerprint(files: Sequence[Path]) -> str:
    """A short hash of weight files by name, size and their first and last SAMPLE bytes: cheap for
    a model of any size, and a changed file changes it."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(files):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE))
            f.seek(max(0, size - SAMPLE))
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def space_of(*parts: object) -> str:
    """The name of the space of workers that compute the same bits: a short hash of `parts`."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def pack(parent: int | None, tokens: Sequence[int], kv: bytes) -> bytes:
    """A block as stored: header, tokens, parent, then its keys and values."""
    head = _HEADER.pack(MAGIC, parent is not None, len(tokens))
    return b"".join((head, struct.pack(f"<{len(tokens)}q", *tokens), (parent or 0).to_bytes(16, "little"), kv))


def unpack(value: bytes | None, parent: int | None, tokens: Sequence[int], kv_bytes: int) -> memoryview | None:
    """The keys and values of a stored block, if it is the block of `tokens` after `parent`."""
    if value is None:
        return None
    body = _HEADER.size + 8 * len(tokens) + 16
    if len(value) != body + kv_bytes or _HEADER.unpack_from(value) != (MAGIC, parent is not None, len(tokens)):
        return None
    stored = struct.unpack_from(f"<{len(tokens)}q", value, _HEADER.size)
    if list(stored) != list(tokens) or value[body - 16:body] != (parent or 0).to_bytes(16, "little"):
        return None
    return memoryview(value)[body:]


@dataclass
class TierCounts:
    """Running totals, for the worker's metrics (worker/engine/backend.py Counts)."""

    hits: int = 0  # blocks fetched
    misses: int = 0  # fetches that ended at a block the tier did not have (one a fetch)
    fetches: int = 0  # lookups that reached Redis
    fetch_seconds: float = 0.0
    bytes_in: int = 0  # fetched
    bytes_out: int = 0  # offloaded
    offloaded: int = 0  # blocks written
    dropped: int = 0  # blocks not offloaded: the writer was behind, or Redis away
    errors: int = 0  # Redis errors (each a miss or dropped blocks, never a failed request)


class KVTier:
    def __init__(self, redis, prefix: str, space: str, kv_bytes: int, budget_bytes: int, ttl_s: float,
                 backlog: int = 256, trim_every_s: float = TRIM_EVERY_S):
        """`redis`: a blocking client (shared/redis_client.connect_blocking) whose commands time
        out quickly; `kv_bytes`: the keys and values of one block."""
        self.trim_every_s = trim_every_s
        self.redis, self.prefix, self.space = redis, prefix, space
        self.kv_bytes = kv_bytes
        self.max_blocks = max(1, budget_bytes // kv_bytes)
        self.ttl_ms = int(ttl_s * 1000)
        self.counts = TierCounts()
        self._lru = redis_keys.kv_blocks_lru(prefix, space)
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._away_until = 0.0
        self._logged_at = -ERROR_LOG_EVERY_S
        self._next_trim = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier", daemon=True)
        self._writer.start()

    def key(self, link: ChainBlock) -> str:
        return redis_keys.kv_block(self.prefix, self.space, link.hash)

    # -- the model thread -------------------------------------------------------------------
    def fetch(self, blocks: Sequence[ChainBlock]) -> list[memoryview]:
        """The keys and values of the leading `blocks` that the tier holds, in order, up to the
        first it does not."""
        if not blocks or self._away():
            return []
        keys = [self.key(link) for link in blocks]
        began = time.perf_counter()
        try:
            # A cluster's keys lie in many slots: its MGET would refuse them, mget_nonatomic splits them.
            values = self.redis.mget_nonatomic(keys) if isinstance(self.redis, RedisCluster) else self.redis.mget(keys)
        except RedisError as exc:
            self._failed("fetch", exc)
            return []
        found = []
        for link, value in zip(blocks, values):
            kv = unpack(value, link.parent, link.tokens, self.kv_bytes)
            if kv is None:
                break
            found.append(kv)
        counts = self.counts
        counts.fetches += 1
        counts.fetch_seconds += time.perf_counter() - began
        counts.hits += len(found)
        counts.misses += len(found) < len(blocks)
        counts.bytes_in += len(found) * self.kv_bytes
        if found:
            self._put(("touch", keys[:len(found)]))
        return found

    def accepting(self, blocks: int) -> bool:
        """Whether `blocks` blocks offloaded now would be written (else they are counted dropped,
        and the caller need not copy them out)."""
        if self._away() or self._queue.qsize() + blocks > self._queue.maxsize:
            self.counts.dropped += blocks
            return False
        return True

    def offload(self, link: ChainBlock, kv: bytes) -> None:
        """Store a block this worker computed (in the background; dropped where the writer is behind)."""
        if not self._put(("set", self.key(link), pack(link.parent, link.tokens, kv))):
            self.counts.dropped += 1

    def flush(self) -> None:
        """Wait until every block handed to offload is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=5)

    # -- the writer thread ------------------------------------------------------------------
    def _put(self, item) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    break
                batch.append(item)
            try:
                self._write(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if item is None:
                break
        self._queue.task_done()

    def _write(self, batch: list) -> None:
        writes = [item for item in batch if item[0] == "set"]
        if self._away():
            self.counts.dropped += len(writes)
            return
        stamp = time.time() * 1000
        try:
            pipe = self.redis.pipeline(transaction=False)
            for kind, *args in batch:
                if kind == "set":
                    key, value = args
                    pipe.set(key, value, px=self.ttl_ms)
                    pipe.zadd(self._lru, {key: stamp})
                else:  # touch: blocks just fetched are used again
                    for key in args[0]:
                        pipe.pexpire(key, self.ttl_ms)
                    pipe.zadd(self._lru, dict.fromkeys(args[0], stamp), xx=True)
            pipe.execute()
            self.counts.offloaded += len(writes)
            self.counts.bytes_out += sum(len(value) for _, _, value in writes)
            self._trim()
        except RedisError as exc:
            self.counts.dropped += len(writes)
            self._failed("offload", exc)
        except Exception:  # a bug: said loudly, and the writer goes on
            self.counts.dropped += len(writes)
            self.counts.errors += 1
            log.exception("KV tier offload failed")

    def _trim(self) -> None:
        """Forget what the TTL expired; evict the least recently used past the budget."""
        now = time.time()
        if now < self._next_trim:
            return
        self._next_trim = now + self.trim_every_s
        self.redis.zremrangebyscore(self._lru, "-inf", now * 1000 - self.ttl_ms)
        excess = self.redis.zcard(self._lru) - self.max_blocks
        if excess > 0:
            evicted = [key for key, _ in self.redis.zpopmin(self._lru, excess)]
            for i in range(0, len(evicted), 256):
                self.redis.delete(*evicted[i:i + 256])

    def _away(self) -> bool:
        return time.monotonic() < self._away_until

    def _failed(self, what: str, exc: Exception) -> None:
        self.counts.errors += 1
        self._away_until = time.monotonic() + AWAY_S
        if time.monotonic() - self._logged_at >= ERROR_LOG_EVERY_S:
            self._logged_at = time.monotonic()
            log.warning("KV tier %s failed (%s: %s); the tier rests %.0f s, prefixes are computed meanwhile",
                        what, type(exc).__name__, exc, AWAY_S)
