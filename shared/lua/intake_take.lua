-- A worker's take of its share of what waits in its model's lanes, and its announcement of the free
-- slots it has left (worker/service/intake.py Intake.take). It removes no lane: intake_drop does, after it.
-- uses: backlog, lanes
-- KEYS[1]: the model's free-slots hash.
-- KEYS[2..]: the lanes to read.
-- ARGV[1]: the workers' consumer group.
-- ARGV[2]: this worker (its consumer name).
-- ARGV[3]: its free slots.
-- ARGV[4]: whether it is idle (0/1).
-- ARGV[5]: the announcement's ttl, in ms.
-- ARGV[6]: the affinity bound, in ms.
-- ARGV[7]: one letter per lane: 'm' this worker's affinity lane, 'a' a lane for any worker, 'o'
--   another worker's affinity lane (its entries may be taken here once they have waited the bound:
--   an entry id starts with the ms it was added, by Redis's clock, as TIME).
-- ARGV[8]: one digit per lane, the rank of its service tier (0 first: shared/service_tier.py); a
--   take goes over the lanes of a better rank before those of the next.
-- ARGV[9..]: each lane's worker ('' but for an 'o' lane).
-- Returns {taken, {index of each 'o' lane that looks abandoned}, {lane index, entry id, {field,
-- value, ...}} ..., last ids, wake ms}: the last ids (one per lane, '0-0' for an empty lane) and the
-- ms until another worker's entry is due here (-1: none waits) only when nothing was taken, for the
-- XREAD that waits for the next entry.

local group, me, free, idle, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
local bound, kinds, ranks = tonumber(ARGV[6]), ARGV[7], ARGV[8]
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
    local due, due_at, unread = due_entries(KEYS[i + 1], math.max(cap, 1), ARGV[8 + i])
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
-- Nobody has a free slot: the head of each of its lanes and of every lane for any worker, of the
-- best tier waiting, for the batcher's fair choice (not another worker's: that one may free a
-- slot first).
local heads = free == 0 and mine + shared > 0 and #others == 0
local reply, taken = {0, gone}, 0
-- Round-robin over the lanes of these kinds (and of this tier rank, when given), an entry at a
-- time, up to `limit` (-1: one per lane), from an affinity lane only what waits (its own: it may
-- have been deleted as empty while this worker did not read), from another's only what is due.
local function take_rank(wanted, limit, rank)
  local got_here, open = 0, {}
  for i = 1, lanes do
    local kind = string.sub(kinds, i, i)
    open[i] = string.find(wanted, kind, 1, true) ~= nil and (kind == 'a' or waiting[i] > 0)
      and (rank == nil or string.sub(ranks, i, i) == rank)
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
-- The lanes of the best tier first, then the next: a flex flood never takes the slots a priority
-- request waits for. (-1: the head of each lane of the best tier with a request waiting.)
local function take(wanted, limit)
  if limit == -1 then  -- the heads of the best tier's lanes that have anything waiting
    local best
    for i = 1, lanes do
      local rank = string.sub(ranks, i, i)
      if waiting[i] > 0 and string.find(wanted, string.sub(kinds, i, i), 1, true) and (not best or rank < best) then
        best = rank
      end
    end
    return best and take_rank(wanted, limit, best) or 0
  end
  local got_here = 0
  for rank = 0, 2 do
    if got_here < limit then got_here = got_here + take_rank(wanted, limit - got_here, tostring(rank)) end
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
