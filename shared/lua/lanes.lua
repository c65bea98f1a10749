-- Library: the free-slot announcements and the affinity lanes, for intake_take and intake_drop.
-- KEYS, ARGV: none of its own; the including script passes its keys and values to the functions.
-- Returns: nothing; it defines three local functions.
--   now_ms(): Redis's clock (TIME) in ms.
--   announced(key, now, prune): the workers whose announcement in the free-slots hash (values
--     "<free>:<expires ms>") has not expired, and their free slots; with `prune`, expired
--     announcements are deleted.
--   abandoned(stream, info, owner, live): whether another worker's affinity lane may go: its worker
--     reads no more (no live announcement: dead, or renamed by a restart) and its stream holds
--     nothing for the group (none pending, no entry after the last delivered); `info` is the group's
--     fields (group_info, from backlog.lua), and a lane without its group stays.

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
