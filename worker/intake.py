"""How a worker takes requests from its model's lanes when other workers share them.

Two rules make M workers split k requests that arrive together about k/M each:
- **Every idle worker hears of new work.** An idle worker waits with a plain XREAD (no
  group) on its lanes and on the new-lane doorbell, from the last ids it saw; a new entry or a
  new lane wakes every waiting worker at once, and then each claims through the group.
  (Read through the group, the doorbell woke one worker only: the others learnt of a new lane
  at their next lane refresh, after the first had taken everything.)
- **Each takes its share, decided with the read.** One script reads the free slots that the
  live workers announced, the requests waiting in the lanes, and takes this worker's part of
  a water-filling split (the emptiest workers fill first, to an equal level), then announces
  what it has left. An idle worker always takes at least one, so a stale announcement of a
  dead worker can slow a burst's spread but never leaves a request waiting with every worker idle.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from shared import redis_keys
from shared.queue import BACKLOG_LUA, RequestQueue

# KEYS: free-slots hash, then the lanes to read. ARGV: group, consumer, free slots, idle (0/1),
# announcement ttl ms. Returns {taken, {lane index, entry id, {field, value, ...}} ...,
# last ids}: the last ids (one per lane, '0-0' for an empty lane) only when nothing was taken,
# for the XREAD that waits for the next entry. Values in the hash are "<free>:<expires ms>".
_TAKE = """
local group, me, free, idle, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local frees = {free}
local announced = redis.call('HGETALL', KEYS[1])
for i = 1, #announced, 2 do
  if announced[i] ~= me then
    local slots, expires = string.match(announced[i + 1], '^(%d+):(%d+)$')
    if expires and tonumber(expires) > now then
      if tonumber(slots) > 0 then frees[#frees + 1] = tonumber(slots) end
    else
      redis.call('HDEL', KEYS[1], announced[i])
    end
  end
end
local waiting = 0
for i = 2, #KEYS do waiting = waiting + lane_backlog(KEYS[i], group) end
-- The water level: what every worker keeps free once the waiting requests are spread.
local share = 0
if waiting > 0 and free > 0 then
  table.sort(frees, function(a, b) return a > b end)
  local level, sum = 0, 0
  for k = 1, #frees do
    sum = sum + frees[k]
    local candidate = (sum - waiting) / k
    if candidate >= (frees[k + 1] or 0) then level = math.max(0, candidate) break end
  end
  share = math.max(0, math.min(free, math.ceil(free - level)))
  if idle then share = math.max(share, 1) end
elseif waiting > 0 and #frees == 1 then
  share = -1  -- nobody has a free slot: the head of each lane, for the batcher's fair choice
end
local reply, taken = {0}, 0
local lanes = #KEYS - 1
local open = {}
for i = 1, lanes do open[i] = true end
local more = true
while more and (share == -1 or taken < share) do
  more = false
  for i = 1, lanes do
    if open[i] and (share == -1 or taken < share) then
      local got = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', 1, 'STREAMS', KEYS[i + 1], '>')
      if got then
        local entry = got[1][2][1]
        reply[#reply + 1] = {i, entry[1], entry[2]}
        taken = taken + 1
        more = share ~= -1
      end
      open[i] = got and share ~= -1
    end
  end
end
reply[1] = taken
if taken == 0 then
  local last = {}
  for i = 1, lanes do
    local top = redis.call('XREVRANGE', KEYS[i + 1], '+', '-', 'COUNT', 1)
    last[i] = top[1] and top[1][1] or '0-0'
  end
  reply[#reply + 1] = last
end
redis.call('HSET', KEYS[1], me, math.max(0, free - taken) .. ':' .. (now + ttl))
return reply
"""


@dataclass
class Taken:
    """What one take() got: (lane stream, entry id, fields) in reading order, and, when it got
    nothing, each lane's last entry id, from which to wait for the next."""
    entries: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    last_ids: dict[str, str] = field(default_factory=dict)


class Intake:
    """One worker's reads of its model's lanes: its share of what waits, and the wait for more."""

    def __init__(self, redis: Redis, queue: RequestQueue, worker: str, ttl_s: float):
        self.redis = redis
        self.queue = queue
        self.worker = worker
        self.ttl_ms = int(ttl_s * 1000)
        self.free_key = redis_keys.worker_free_slots(queue.prefix, queue.model)
        self._take = redis.register_script(BACKLOG_LUA + _TAKE)

    async def lanes(self, backend: str) -> tuple[list[str], str]:
        """The lanes a worker of `backend` reads, and the doorbell's last id when they were read
        (waiting from that id, a lane added since wakes the worker)."""
        # The doorbell first: a lane added after that read rings it after the id read, so the
        # wait from it wakes. (One slot, one node: a pipeline keeps the order, on a cluster too.)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self.queue.doorbell, count=1)
            pipe.smembers(self.queue.lanes_key)
            top, members = await pipe.execute()
        return self.queue.lane_streams(members, backend), top[0][0] if top else "0-0"

    async def take(self, lanes: list[str], free: int, idle: bool) -> Taken:
        """Claim this worker's share of the requests waiting in `lanes` (with no free slot and
        nobody else free, the head of each lane), and announce the free slots left."""
        reply = await self._take(keys=[self.free_key, *lanes],
                                 args=[redis_keys.WORKER_GROUP, self.worker, free, int(idle), self.ttl_ms])
        taken = Taken(entries=[(lanes[i - 1], entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                               for i, entry_id, flat in reply[1:1 + reply[0]]])
        if not taken.entries:
            taken.last_ids = dict(zip(lanes, reply[-1], strict=True))
        return taken

    async def wait(self, last_ids: dict[str, str], doorbell_id: str, block_ms: int) -> bool:
        """Wait until a lane gets an entry after its last id, or a lane is added after
        `doorbell_id`, or `block_ms` passes. True when a lane was added."""
        reply = await self.redis.xread({self.queue.doorbell: doorbell_id, **last_ids}, count=1, block=block_ms)
        return any(stream == self.queue.doorbell for stream, _ in reply or [])

    async def withdraw(self) -> None:
        """This worker takes nothing more: others need not leave it a share."""
        await self.redis.hdel(self.free_key, self.worker)

