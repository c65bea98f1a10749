-- One result of an offline batch and its count, in one step, each once: a job run again finds the
-- result written (scheduler/batches.py run_batch).
-- KEYS[1]: the batch's results hash.
-- KEYS[2]: the batch's record (one slot with the results: the batch id).
-- ARGV[1]: the request's custom id.
-- ARGV[2]: the result line (JSON).
-- ARGV[3]: the record's count to add it to (BatchField.COMPLETED or FAILED).
-- Returns nothing (nil).

if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
