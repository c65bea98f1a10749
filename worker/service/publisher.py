"""Publish one step's results: every event of the step in ONE Redis pipeline. A request this
worker surely still holds (worker/service/lease.py: its heartbeats unbroken since it claimed it)
is written by plain commands in one MULTI/EXEC, its record WATCHed before the lease is asked; any
other by a script (shared/lua/publisher_publish.lua) that writes only while the record says the
request is still this worker's, so a worker that lost a request to a takeover adds nothing to its
token log. Both write the same keys and fields."""
from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, WatchError

from shared import redis_keys, scripts
from shared.messages import STATUS_OF_FINISH, FinalEvent, Usage, encode_event, now
from shared.queue import RequestQueue
from shared.redis_client import is_cluster
from shared.request_record import RecordField
from worker.engine.sequence import RequestEnd, StepOutput
from worker.service.lease import Lease


class Publisher:
    def __init__(self, redis: Redis, queue: RequestQueue, worker: str, lease: Lease | None = None):
        """`lease`: where given, requests it holds skip the script's check (None: never)."""
        self.redis = redis
        self.prefix = queue.prefix
        self.queue = queue
        self.worker = worker  # the name its claims wrote in the records: what the script checks
        self.entries: dict[str, str] = {}  # request id -> its queue entry, acked when the request ends
        self.lease = lease
        self.claimed_at: dict[str, float] = {}  # request id -> when it was claimed (the lease's clock)
        self._script = scripts.register(redis, "publisher_publish")

    def taken(self, request_id: str, entry_id: str) -> None:
        """A request the backend now runs, from this queue entry."""
        self.entries[request_id] = entry_id
        if self.lease is not None:
            self.claimed_at[request_id] = self.lease.clock()

    async def publish(self, outputs: list[StepOutput]) -> list[str]:
        """Token log XADD + SPUBLISH for each new token; on finish the record, final event and XACK.
        Returns the requests it wrote nothing for: no longer this worker's (another took them over)."""
        if not outputs:
            return []
        stamp = now()
        calls = {rid: self._args(rid, outs, stamp) for rid, outs in _by_request(outputs).items()}
        held = await self._write_held(calls)
        written = dict.fromkeys(held, True) | await self._run({r: a for r, a in calls.items() if r not in held})
        ended = [out for out in outputs if out.finished and out.request_id in self.entries]
        if ended:
            # Outside the script (the lane lies in another slot); an entry already taken back is acked: a no-op.
            async with self.redis.pipeline(transaction=False) as pipe:
                for out in ended:
                    pipe.xack(self.queue.lane_stream(out.lane), redis_keys.WORKER_GROUP, self.entries[out.request_id])
                await pipe.execute()
        for out in ended:  # only once published: a retried publish acks them again
            self.entries.pop(out.request_id, None)
            self.claimed_at.pop(out.request_id, None)
        return [rid for rid in calls if not written[rid]]

    async def _write_held(self, calls: dict[str, list]) -> list[str]:
        """Write by plain commands the requests the lease holds; the ones written. Their records are
        WATCHed first and the lease asked once the WATCH has reached Redis: a takeover before then the
        lease rules out, and one after it (this process paused between the answer and the write) changes
        a record, so Redis refuses the whole MULTI/EXEC and they all go through the script. On a Redis
        Cluster (whose client runs no WATCH over many slots) every request goes through the script."""
        watched = [rid for rid in calls if self._held(rid)]
        if not watched or is_cluster(self.redis):
            return []
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(*(calls[rid][0] for rid in watched))
            held = [rid for rid in watched if self._held(rid)]  # asked again: the WATCH is in place
            if not held:
                return []
            pipe.multi()
            for rid in held:
                _write(pipe, calls[rid])
            try:
                await pipe.execute()
            except WatchError:  # a watched record changed: a takeover, or any other write to it
                return []
        return held

    def _held(self, rid: str) -> bool:
        claimed = self.claimed_at.get(rid)
        return self.lease is not None and claimed is not None and self.lease.holds(claimed)

    async def _run(self, calls: dict[str, list]) -> dict[str, bool]:
        """Each request's script call in one pipeline; those Redis had lost the script for, again once
        loaded. On a Redis Cluster (whose client pipelines no script) each call by itself, all at once:
        each runs on its request's node, and the script object loads itself where a node lacks it."""
        if is_cluster(self.redis):
            results = await asyncio.gather(*(self._script(keys=args[:3], args=args[3:]) for args in calls.values()))
            return {rid: bool(result) for rid, result in zip(calls, results, strict=True)}
        written: dict[str, bool] = {}
        while calls:
            async with self.redis.pipeline(transaction=False) as pipe:
                for args in calls.values():
                    pipe.evalsha(self._script.sha, 3, *args)
                results = await pipe.execute(raise_on_error=False)
            lost = {}
            for (rid, args), result in zip(calls.items(), results, strict=True):
                if isinstance(result, NoScriptError):  # Redis restarted or flushed: nothing of it was written
                    lost[rid] = args
                elif isinstance(result, Exception):
                    raise result
                else:
                    written[rid] = bool(result)
            if lost:
                await self.redis.script_load(self._script.script)
            calls = lost
        return written

    def _args(self, rid: str, outs: list[StepOutput], stamp: float) -> list:
        """The script's KEYS and ARGV for one request's outputs of a step (its header says them)."""
        tokens = [encode_event(out.token) for out in outs if out.token is not None]
        first = next((out for out in outs if out.token is not None and out.token.index == 0), None)
        # When its first step began, where a backend says.
        begun = first.scheduled_at if first is not None and first.scheduled_at else ""
        end = next((out.end for out in outs if out.finished), None)
        keys = [redis_keys.request_record(self.prefix, rid), redis_keys.token_log(self.prefix, rid),
                redis_keys.request_channel(self.prefix, rid)]
        return [*keys, self.worker, len(tokens), *tokens, stamp if first is not None else "", begun,
                *(_end(end, stamp) if end is not None else [""])]


def _write(pipe, args: list) -> None:
    """What the script writes for these KEYS and ARGV (its header), as plain commands, unchecked."""
    record, log, channel, _worker, n = args[:5]
    for data in args[5:5 + n]:
        pipe.xadd(log, {redis_keys.EVENT_FIELD: data})
        pipe.execute_command("SPUBLISH", channel, data)
    first, begun, end = args[5 + n], args[6 + n], args[7 + n:]
    if first != "":
        pipe.hset(record, RecordField.FIRST_TOKEN_AT, first)
    if begun != "":
        pipe.hset(record, RecordField.SCHEDULED_AT, begun)
    if end[0] == "":
        return
    final, status, reason, completion, finished, text, reused, error, ttl = end
    pipe.hset(record, mapping={RecordField.STATUS: status, RecordField.FINISH_REASON: reason,
                               RecordField.COMPLETION_TOKENS: completion, RecordField.FINISHED_AT: finished,
                               RecordField.TEXT: text, RecordField.REUSED_TOKENS: reused})
    if error:
        pipe.hset(record, RecordField.ERROR, error)
    pipe.xadd(log, {redis_keys.EVENT_FIELD: final})
    pipe.execute_command("SPUBLISH", channel, final)
    pipe.expire(record, ttl)
    pipe.expire(log, ttl)


def _end(end: RequestEnd, stamp: float) -> list:
    """The final event and the record's values of the end, as the script takes them."""
    usage = Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                  cached_tokens=min(end.reused_tokens, end.prompt_tokens))
    status = STATUS_OF_FINISH[end.finish_reason]
    pooled = list(end.pooled) if end.pooled is not None else None
    final = encode_event(FinalEvent(status=status, finish_reason=end.finish_reason, usage=usage, error=end.error,
                                    code=end.code, pooled=pooled))
    return [final, status.value, end.finish_reason.value, usage.completion_tokens, stamp, end.text,
            end.reused_tokens, end.error or "", redis_keys.RESULT_TTL_S]


def _by_request(outputs: list[StepOutput]) -> dict[str, list[StepOutput]]:
    """The step's outputs of each request, in order (a speculative step emits several of one)."""
    grouped: dict[str, list[StepOutput]] = {}
    for out in outputs:
        grouped.setdefault(out.request_id, []).append(out)
    return grouped
