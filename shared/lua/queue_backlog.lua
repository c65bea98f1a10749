-- A model's backlog over all its lanes (shared/queue.py RequestQueue.backlog).
-- uses: backlog
-- KEYS[1]: the model's lanes set.
-- ARGV[1]: the lane streams' key prefix (a lane's stream is it and the lane).
-- ARGV[2]: the workers' consumer group.
-- Returns {requests no worker has taken yet, requests ever taken}, summed over the lanes.

return {backlog(KEYS[1], ARGV[1], ARGV[2])}
