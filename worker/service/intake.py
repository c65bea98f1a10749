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

With prefix affinity (shared/prefix_affinity.py), a request the api marked for a worker waits in
that worker's affinity lane. That worker takes from its affinity lanes first (up to its free
slots), then its split of the rest; the others take an entry of its affinity lanes only once
the entry has waited the bound, so a busy or dead worker's requests go elsewhere after it.
Worker names change at each start, so a dead worker's affinity lanes would stay for good: once
one is empty, with nothing pending, and its worker announces nothing, a take reports it and a
second script (_DROP) removes it, checking again as it does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from shared import redis_keys
from shared.queue import BACKLOG_LUA, RequestQueue, affinity_of

# Lua functions for both scripts. now_ms: Redis's clock (TIME) in ms. announced: the workers
# whose announcement in the free-slots hash (values "<free>:<expires ms>") has not expired, and
# their free slots; with `prune`, expired announcements are deleted. abandoned: whether another
# worker's affinity lane may go: its worker reads no more (no live announcement: dead, or renamed
# by a restart) and its stream holds nothing for the group (none pending, no entry after the last
# delivered); `info` is the group's fields (group_info), and a lane without its group stays.
_LANES_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function announced(key, now, prune)
  local live, all = {}, redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local slots, expires = string.match(all[i + 1], '^(%d+):(%d+)$')
    if expires and tonumber(expires) > now then
      live[all[i]] = tonumber(slots)
    elseif prune then
      redis.call('HDEL', key, all[i])
    end
  end
  return live
end

local function abandoned(stream, info, owner, live)
  return info ~= nil and live[owner] == nil and tonumber(info['pending']) == 0
    and redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+', 'COUNT', 1)[1] == nil
end
"""

# KEYS: free-slots hash, then the lanes to read. ARGV: group, consumer, free slots, idle (0/1),
# announcement ttl ms, affinity bound ms, one letter per lane: 'm' this worker's affinity lane,
# 'a' a lane for any worker, 'o' another worker's affinity lane (its entries may be taken here
# once they have waited the bound: an entry id starts with the ms it was added, by Redis's clock,
# as TIME); then each lane's worker ('' but for an 'o' lane).
# Returns {taken, {index of each 'o' lane that looks abandoned}, {lane index, entry id, {field,
# value, ...}} ..., last ids, wake ms}: the last ids (one per lane, '0-0' for an empty lane) and
# the ms until another worker's entry is due here (-1: none waits) only when nothing was taken,
# for the XREAD that waits for the next entry. It removes no lane: _DROP does, after it.
_TAKE = """
local group, me, free, idle, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
local bound, kinds = tonumber(ARGV[6]), ARGV[7]
local now = now_ms()
local reading = announced(KEYS[1], now, true)
reading[me] = nil
local others = {}
for _, slots in pairs(reading) do
  if slots > 0 then others[#others + 1] = slots end
end
-- Entries of another worker's affinity lane that have waited the bound (at most `cap`), the ms
-- when its next entry will have, and whether the lane looks abandoned.
local function due_entries(stream, cap, owner)
  local info = group_info(stream, group)
  if not info then return 0, nil, false end
  local last = info['last-delivered-id']
  local due = redis.call('XRANGE', stream, '(' .. last, now - bound, 'COUNT', cap)
  local after = due[#due] and due[#due][1] or last
  local next_entry = redis.call('XRANGE', stream, '(' .. after, '+', 'COUNT', 1)[1]
  local unread = #due == 0 and not next_entry and abandoned(stream, info, owner, reading)
  return #due, next_entry and tonumber(string.match(next_entry[1], '^(%d+)')) + bound, unread
end
-- What waits: for this worker ('m' lanes), and for any worker ('a' lanes, and what is due of 'o' lanes).
local lanes = #KEYS - 1
local cap = free
for _, slots in ipairs(others) do cap = cap + slots end
local waiting, mine, shared, wake, gone = {}, 0, 0, -1, {}
for i = 1, lanes do
  local kind = string.sub(kinds, i, i)
  if kind == 'o' then
    local due, due_at, unread = due_entries(KEYS[i + 1], math.max(cap, 1), ARGV[7 + i])
    waiting[i] = due
    if due_at and (wake < 0 or due_at - now < wake) then wake = math.max(0, due_at - now) end
    if unread then gone[#gone + 1] = i end
  else
    waiting[i] = lane_backlog(KEYS[i + 1], group)
  end
  if kind == 'm' then mine = mine + waiting[i] else shared = shared + waiting[i] end
end
-- Its own affinity lanes first: nobody else takes them before the bound.
local own = math.min(free, mine)
local room = free - own
-- Of what any worker may take, its part of a water-filling split: the emptiest workers fill
-- first, to an equal level, what every worker keeps free once the waiting requests are spread.
local share = 0
if shared > 0 and room > 0 then
  local frees = {room}
  for _, slots in ipairs(others) do frees[#frees + 1] = slots end
  table.sort(frees, function(a, b) return a > b end)
  local level, sum = 0, 0
  for k = 1, #frees do
    sum = sum + frees[k]
    local candidate = (sum - shared) / k
    if candidate >= (frees[k + 1] or 0) then level = math.max(0, candidate) break end
  end
  share = math.max(0, math.min(room, math.ceil(room - level)))
  if idle and own == 0 then share = math.max(share, 1) end
end
-- Nobody has a free slot: the head of each of its lanes and of every lane for any worker, for
-- the batcher's fair choice (not another worker's: that one may free a slot first).
local heads = free == 0 and mine + shared > 0 and #others == 0
local reply, taken = {0, gone}, 0
-- Round-robin over the lanes of these kinds, an entry at a time, up to `limit` (-1: one per lane),
-- from an affinity lane only what waits (its own: it may have been deleted as empty while this
-- worker did not read), from another's only what is due.
local function take(wanted, limit)
  local got_here, open = 0, {}
  for i = 1, lanes do
    local kind = string.sub(kinds, i, i)
    open[i] = string.find(wanted, kind, 1, true) ~= nil and (kind == 'a' or waiting[i] > 0)
  end
  local more = true
  while more and (limit == -1 or got_here < limit) do
    more = false
    for i = 1, lanes do
      if open[i] and (limit == -1 or got_here < limit) then
        local got = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', 1, 'STREAMS', KEYS[i + 1], '>')
        if got then
          local entry = got[1][2][1]
          reply[#reply + 1] = {i, entry[1], entry[2]}
          got_here = got_here + 1
          waiting[i] = waiting[i] - 1
          more = limit ~= -1
        end
        open[i] = got and limit ~= -1 and (string.sub(kinds, i, i) == 'a' or waiting[i] > 0)
      end
    end
  end
  return got_here
end
if heads then
  taken = take('ma', -1)
else
  if own > 0 then taken = take('m', own) end
  if share > 0 then taken = taken + take('ao', share) end
end
reply[1] = taken
if taken == 0 then
  local last = {}
  for i = 1, lanes do
    local top = redis.call('XREVRANGE', KEYS[i + 1], '+', '-', 'COUNT', 1)
    last[i] = top[1] and top[1][1] or '0-0'
  end
  reply[#reply + 1] = last
  reply[#reply + 1] = wake
end
redis.call('HSET', KEYS[1], me, math.max(0, free - taken) .. ':' .. (now + ttl))
return reply
"""

# KEYS: free-slots hash, lanes set, then the streams of other workers' affinity lanes that a
# take found abandoned. ARGV: group, then each lane's name and its worker. Removes those still
# abandoned from the lanes set and deletes their streams; returns the streams removed.
# Removing is a script of its own, apart from the take, and safe so: it checks again, and removes
# in the same script, so what the take saw may be stale and nothing rests on it. The api's submit
# (_SUBMIT, shared/store.py) is one script on the same slot: it runs wholly before this one (the
# lane then holds its entry and stays) or wholly after (its SADD then finds the lane gone, so it
# creates the stream and its group again and rings the doorbell, as for any new lane). A worker
# that comes back (announces) in between keeps its lanes; an entry taken and not acked is pending.
_DROP = """
local group, live = ARGV[1], announced(KEYS[1], now_ms(), false)
local dropped = {}
for i = 3, #KEYS do
  local lane, owner = ARGV[2 * i - 4], ARGV[2 * i - 3]
  if abandoned(KEYS[i], group_info(KEYS[i], group), owner, live) then
    redis.call('SREM', KEYS[2], lane)
    redis.call('DEL', KEYS[i])
    dropped[#dropped + 1] = KEYS[i]
  end
end
return dropped
"""


@dataclass
class Taken:
    """What one take() got: (lane stream, entry id, fields) in reading order, and, when it got
    nothing, each lane's last entry id, from which to wait for the next, and the ms until an
    entry of another worker's affinity lane may be taken here (None: none waits). `abandoned`:
    other workers' affinity lanes it found abandoned, for drop()."""
    entries: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    last_ids: dict[str, str] = field(default_factory=dict)
    due_in_ms: int | None = None
    abandoned: list[str] = field(default_factory=list)


class Intake:
    """One worker's reads of its model's lanes: its share of what waits, and the wait for more.

    With `affinity_wait_ms` (prefix affinity on), it takes from its own affinity lanes first,
    and from another worker's only the entries that have waited that long; without it, every
    lane is any worker's."""

    def __init__(self, redis: Redis, queue: RequestQueue, worker: str, ttl_s: float,
                 affinity_wait_ms: int | None = None):
        self.redis = redis
        self.queue = queue
        self.worker = worker
        self.ttl_ms = int(ttl_s * 1000)
        self.affinity_wait_ms = affinity_wait_ms
        self.free_key = redis_keys.worker_free_slots(queue.prefix, queue.model)
        self._take = redis.register_script(BACKLOG_LUA + _LANES_LUA + _TAKE)
        self._drop = redis.register_script(BACKLOG_LUA + _LANES_LUA + _DROP)

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
        nobody else free, the head of each lane), and announce the free slots left; report the
        other workers' affinity lanes that look abandoned (Taken.abandoned, for drop)."""
        kinds = [self._kind(lane) for lane in lanes]
        owners = [self._owner(lane) if kind == "o" else "" for lane, kind in zip(lanes, kinds, strict=True)]
        reply = await self._take(keys=[self.free_key, *lanes],
                                 args=[redis_keys.WORKER_GROUP, self.worker, free, int(idle), self.ttl_ms,
                                       self.affinity_wait_ms or 0, "".join(kinds), *owners])
        count, abandoned = reply[0], reply[1]
        taken = Taken(entries=[(lanes[i - 1], entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                               for i, entry_id, flat in reply[2:2 + count]],
                      abandoned=[lanes[i - 1] for i in abandoned])
        if not taken.entries:
            taken.last_ids = dict(zip(lanes, reply[-2], strict=True))
            taken.due_in_ms = None if reply[-1] < 0 else reply[-1]
        return taken

    async def drop(self, streams: list[str]) -> list[str]:
        """Remove those of these other workers' affinity lanes that are still abandoned (their
        worker reads no more, nothing in them waits or is pending) and delete their streams;
        the streams removed. A request queued there later creates its lane again. Apart from
        take(), so that each is one script, safe to repeat on its own."""
        args = [redis_keys.WORKER_GROUP]
        for stream in streams:
            args += [stream.removeprefix(self.queue.stream_prefix), self._owner(stream) or ""]
        return await self._drop(keys=[self.free_key, self.queue.lanes_key, *streams], args=args)

    def _owner(self, stream: str) -> str | None:
        """The worker whose affinity lane this is (None: any worker's)."""
        return affinity_of(stream.removeprefix(self.queue.stream_prefix))

    def _kind(self, stream: str) -> str:
        """'m': this worker's affinity lane, 'o': another worker's, 'a': any worker's."""
        owner = self._owner(stream)
        if owner is None or self.affinity_wait_ms is None:
            return "a"
        return "m" if owner == self.worker else "o"

    async def wait(self, last_ids: dict[str, str], doorbell_id: str, block_ms: int) -> bool:
        """Wait until a lane gets an entry after its last id, or a lane is added after
        `doorbell_id`, or `block_ms` passes. True when a lane was added."""
        reply = await self.redis.xread({self.queue.doorbell: doorbell_id, **last_ids}, count=1, block=block_ms)
        return any(stream == self.queue.doorbell for stream, _ in reply or [])

    async def withdraw(self) -> None:
        """This worker takes nothing more: others need not leave it a share."""
        await self.redis.hdel(self.free_key, self.worker)

