-- Removes other workers' affinity lanes that a take found abandoned and that still are
-- (worker/service/intake.py Intake.drop), and deletes their streams.
-- Removing is a script of its own, apart from the take, and safe so: it checks again, and removes
-- in the same script, so what the take saw may be stale and nothing rests on it. The api's submit
-- (store_submit) is one script on the same slot: it runs wholly before this one (the lane then holds
-- its entry and stays) or wholly after (its SADD then finds the lane gone, so it creates the stream
-- and its group again and rings the doorbell, as for any new lane). A worker that comes back
-- (announces) in between keeps its lanes; an entry taken and not acked is pending.
-- uses: backlog, lanes
-- KEYS[1]: the model's free-slots hash.
-- KEYS[2]: the model's lanes set.
-- KEYS[3..]: the streams of the other workers' affinity lanes that a take found abandoned.
-- ARGV[1]: the workers' consumer group.
-- ARGV[2..]: for each of those streams, its lane's name, then the lane's worker.
-- Returns the streams removed.

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
