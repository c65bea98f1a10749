-- Who holds each prompt prefix (shared/prefix_affinity.py PrefixAffinity.route).
-- KEYS[1]: the model's prefix holders hash.
-- KEYS[2]: the model's free-slots hash (worker/service/intake.py).
-- ARGV[1..]: the prefix hashes.
-- Returns, for each hash, the workers whose announcement of it has not expired by Redis's clock
-- (the workers' expiries are in that clock too), those with the most free slots first, then the latest.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local found = redis.call('HMGET', KEYS[1], unpack(ARGV))
local free_of = {}
for i, value in ipairs(found) do
  local holders = {}
  for held in string.gmatch(value or '', '[^/]+') do
    local until_ms, worker = string.match(held, '^(%d+):(.*)$')
    if tonumber(until_ms) > now then
      if not free_of[worker] then
        local slots, free_until = string.match(redis.call('HGET', KEYS[2], worker) or '', '^(%d+):(%d+)$')
        free_of[worker] = free_until and tonumber(free_until) > now and tonumber(slots) or 0
      end
      holders[#holders + 1] = {worker, free_of[worker], #holders}
    end
  end
  table.sort(holders, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[3] < b[3]) end)
  for k, holder in ipairs(holders) do holders[k] = holder[1] end
  found[i] = holders
end
return found
