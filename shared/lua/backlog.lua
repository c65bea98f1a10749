-- Library: the backlog of a model's lanes, for the scripts that need it (queue_backlog, store_submit,
-- intake_take, intake_drop).
-- KEYS, ARGV: none of its own; the including script passes its keys and values to the functions.
-- Returns: nothing; it defines three local functions.
--   group_info(stream, group): the fields of `group` on `stream` (a table: name, last-delivered-id,
--     pending, entries-read, lag, ...), nil where the stream or the group does not exist; and
--     whether the stream does.
--   lane_backlog(stream, group): (entries no worker has taken yet, entries ever taken) of one lane's
--     stream, from its group (its lag and entries-read; where Redis cannot tell the lag,
--     entries-added less entries-read).
--   backlog(lanes_key, stream_prefix, group): the same summed over every lane in the lanes set. It
--     reads the lanes' streams without being given them as KEYS: they share the lanes set's slot
--     (the model's hash tag), so this runs on a Cluster's node that holds it.

local function group_info(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil, false end  -- no such stream (yet)
  for _, g in ipairs(groups) do
    local fields = {}
    for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
    if fields['name'] == group then return fields, true end
  end
  return nil, true
end

local function lane_backlog(stream, group)
  local info, exists = group_info(stream, group)
  if not exists then return 0, 0 end
  if not info then return redis.call('XLEN', stream), 0 end
  local read = tonumber(info['entries-read']) or 0
  local lag = tonumber(info['lag'])
  if not lag then
    local stream_info = redis.call('XINFO', 'STREAM', stream)
    for i = 1, #stream_info, 2 do
      if stream_info[i] == 'entries-added' then lag = math.max(0, stream_info[i + 1] - read) end
    end
  end
  return lag, read
end

local function backlog(lanes_key, stream_prefix, group)
  local waiting, taken = 0, 0
  for _, lane in ipairs(redis.call('SMEMBERS', lanes_key)) do
    local lag, read = lane_backlog(stream_prefix .. lane, group)
    waiting, taken = waiting + lag, taken + read
  end
  return waiting, taken
end
