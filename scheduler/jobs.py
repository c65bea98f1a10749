"""Periodic jobs. Each is safe to run twice, and by several schedulers at once."""
from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys

log = logging.getLogger(__name__)


async def trim_request_stream(redis: Redis, prefix: str, model: str) -> int:
    """Drop request-stream entries that every worker is done with; return how many went.

    An entry is kept while it is unread (after the group's last-delivered id) or pending (read,
    not yet acked: its request may still need reclaiming). Everything older than both goes.
    """
    stream = keys.request_stream(prefix, model)
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream yet
        return 0
    group = next((g for g in groups if g["name"] == keys.WORKER_GROUP), None)
    if group is None:
        return 0
    floor = group["last-delivered-id"]
    pending = await redis.xpending(stream, keys.WORKER_GROUP)
    if pending["pending"]:
        floor = min(floor, pending["min"], key=_entry_order)
    if floor == "0-0":
        return 0
    removed = await redis.xtrim(stream, minid=floor, approximate=False)
    if removed:
        log.info("trimmed %d finished entries from %s", removed, stream)
    return removed


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
