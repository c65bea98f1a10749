"""Every Redis key and channel name, built in one place.

Each request's keys carry ``{id}`` as a hash tag, so they land in one slot on Redis Cluster;
a model's queue (its lanes, doorbell and free-slot announcements) carries ``{model}``, so a
worker's take of every lane is one script on one slot. Different requests, and different
models' queues, spread over the slots.
"""

# Consumer group that every worker of a model joins on that model's request stream.
WORKER_GROUP = "workers"

# A finished request's record and token log stay this long, so late polls and stream
# resumes still find them; then Redis frees them.
RESULT_TTL_S = 24 * 3600
IMAGE_TTL_S = 3600  # an image's bytes, from its latest request or claim (image)

# Consumer name under which the scheduler holds an entry while it puts it back in the queue;
# it has no heartbeat, so an entry left there by a scheduler that died is reclaimed again.
RECLAIMER = "reclaimer"

# Field of a token-log entry that holds the encoded event.
EVENT_FIELD = "e"


def request_stream(prefix: str, model: str, lane: str) -> str:
    """Stream of one lane's requests for one served model (consumer group WORKER_GROUP).

    A lane is a tenant and a priority (shared/queue.py): one stream each, so a worker sees the
    head of every tenant's queue and can share its batch fairly, whatever the backlogs."""
    return f"{prefix}:requests:{{{model}}}:{lane}"


def request_lanes(prefix: str, model: str) -> str:
    """Set: the lanes that have a request stream for this model. A tenant's lane stays; a worker's
    affinity lane is removed with its stream once it is empty, nothing of it is pending and its
    worker has no live announcement in worker_free_slots (it stopped reading: worker/service/intake.py's
    drop, shared/lua/intake_drop.lua); a request queued there later adds it again, with its group."""
    return f"{prefix}:lanes:{{{model}}}"


def request_lanes_pattern(prefix: str) -> str:
    """SCAN pattern matching every model's request_lanes set (not the doorbells, which end `:new`)."""
    return f"{prefix}:lanes:{{*}}"


def model_of_lanes(prefix: str, key: str) -> str:
    """The model whose request_lanes set `key` is."""
    return key[len(f"{prefix}:lanes:{{"):-1]


def lane_doorbell(prefix: str, model: str) -> str:
    """Stream with one entry per new lane, read without a group (XREAD), so every worker
    waiting on the lanes it knew wakes up and reads the new one at once."""
    return f"{prefix}:lanes:{{{model}}}:new"


def worker_free_slots(prefix: str, model: str) -> str:
    """Hash: worker -> "<free slots>:<expiry, ms>", announced at each of its reads of the lanes,
    so workers split a burst by their free room (worker/service/intake.py). An entry past its expiry
    is a worker that stopped reading: the next reader drops it."""
    return f"{prefix}:free:{{{model}}}"


def prefix_holders(prefix: str, model: str) -> str:
    """Hash: prompt-prefix hash -> "<expiry, ms>:<worker>/...", the last few workers that took a
    request with that prefix (so hold its KV blocks), announced at their intake
    (shared/prefix_affinity.py). In the model's queue slot (`{model}` hash tag): the announcing
    script also writes the next key, the api's lookup reads worker_free_slots."""
    return f"{prefix}:prefixes:{{{model}}}"


def prefix_expiry(prefix: str, model: str) -> str:
    """Sorted set: prompt-prefix hash -> its announcement's expiry (ms), so expired entries of
    prefix_holders are found and dropped without scanning the hash; same slot."""
    return f"{prefix}:prefixes:{{{model}}}:expiry"


def model_files(prefix: str, model: str) -> str:
    """Hash: file name -> content of a served model's tokenizer files, written by its workers
    at start, so any api replica can take requests for any served model."""
    return f"{prefix}:model:{model}:files"


def lora_adapters(prefix: str, model: str) -> str:
    """Hash: the LoRA adapters loaded at run time for a model (/v1/load_lora_adapter), name -> JSON
    {path, tenants}. No TTL: they stay served until unloaded; every worker of the model reads it at
    its heartbeat, every api replica when a request names an adapter."""
    return f"{prefix}:lora:{{{model}}}"


def lora_revision(prefix: str, model: str) -> str:
    """String: a counter bumped by every /v1/load_lora_adapter of the model, its value the loaded
    entry's revision, so a worker tells a load under a name apart from the one before it (its
    weights are loaded again). Same slot as lora_adapters; no TTL, and never reset by an unload: a
    revision is never given twice."""
    return f"{prefix}:lora:{{{model}}}:revision"


def model_commit(prefix: str, repo: str, revision: str) -> str:
    """String: the commit a hub model's revision (a branch or tag) resolved to, set once (SET NX)
    by the first process of the deployment, so the api and every worker load one snapshot. No
    TTL: a later push to the branch changes nothing until this key is deleted (shared/hub_revision.py)."""
    return f"{prefix}:model:{repo}:commit:{revision}"


def kv_block(prefix: str, space: str, block_hash: int) -> str:
    """String with TTL: one full KV-cache block of the shared tier (worker/engine/kv_tier.py), keyed by
    its space (model, dtype, quantization and numerics: only workers that compute the same bits
    share) and the stable hash of its tokens' chain. No hash tag: on a cluster the blocks spread
    over every slot."""
    return f"{prefix}:kv:{space}:{block_hash:032x}"


def kv_blocks_lru(prefix: str, space: str) -> str:
    """Sorted set: the space's block keys by last use (ms); the tier evicts its oldest past
    its byte budget, and drops those older than the blocks' TTL (expired by Redis already)."""
    return f"{prefix}:kv:{space}:lru"


def image(prefix: str, sha256: str) -> str:
    """String: an image's bytes as a request sent them (base64: the clients decode replies as text), named by their sha256 (one copy however
    many requests send it), kept IMAGE_TTL_S from its latest request or claim, so a worker that takes a
    request over has its images too."""
    return f"{prefix}:image:{sha256}"


def request_record(prefix: str, request_id: str) -> str:
    """Hash: status, tenant, params, timestamps, worker, usage, finish reason, error; its fields are
    named in shared/request_record.py."""
    return f"{prefix}:req:{{{request_id}}}"


def token_log(prefix: str, request_id: str) -> str:
    """Stream: one entry per generated token, then the final event."""
    return f"{prefix}:req:{{{request_id}}}:tokens"


def request_channel(prefix: str, request_id: str) -> str:
    """Pub/sub channel carrying the same events as the token log, live."""
    return f"{prefix}:req:{{{request_id}}}:ch"


def cancel_channel(prefix: str) -> str:
    """Pub/sub channel on which the api tells every worker to stop a running request."""
    return f"{prefix}:cancel"


def worker_heartbeat(prefix: str, worker: str) -> str:
    """String with TTL: the worker's heartbeat (shared/heartbeat.py Heartbeat): model, backend, capacity, load."""
    return f"{prefix}:worker:{worker}"


def worker_heartbeat_pattern(prefix: str) -> str:
    """SCAN pattern matching every worker heartbeat."""
    return f"{prefix}:worker:*"


def replica_channel(prefix: str, replica: str) -> str:
    """Pub/sub channel an api replica always holds, so its one connection is never idle."""
    return f"{prefix}:api:{replica}"


def dead_letter_stream(prefix: str) -> str:
    """Requests that failed too many attempts, with the reason."""
    return f"{prefix}:dead"


def response_record(prefix: str, tenant: str, response_id: str) -> str:
    """Hash: a stored response of the Responses API under its tenant (its request's id, settings,
    input items, conversation); it expires after the responses' retention (api/openai/responses/store.py)."""
    return f"{prefix}:resp:{tenant}:{{{response_id}}}"


def kept_responses(prefix: str) -> str:
    """Sorted set: stored responses kept longer than RESULT_TTL_S whose request may not have
    ended yet, as JSON [tenant, response id, request id] by creation time; the scheduler's
    keep_responses extends each finished request's record and token log to its response's
    expiry, then removes it."""
    return f"{prefix}:resp-kept"


def batch_record(prefix: str, batch_id: str) -> str:
    """Hash: an offline batch's status, endpoint, tenant, counts and timestamps; its fields are named
    in shared/batch_record.py."""
    return f"{prefix}:batch:{{{batch_id}}}"


def batch_items(prefix: str, batch_id: str) -> str:
    """List: the batch's requests in order, each {custom_id, endpoint, payloads} as JSON."""
    return f"{prefix}:batch:{{{batch_id}}}:items"


def batch_results(prefix: str, batch_id: str) -> str:
    """Hash: custom_id -> the result line, OpenAI's batch output shape, as JSON."""
    return f"{prefix}:batch:{{{batch_id}}}:results"


def file_record(prefix: str, file_id: str) -> str:
    """Hash: one file of the Files API, its metadata and its bytes in one key, so one TTL ends both;
    its fields are named in shared/files.py."""
    return f"{prefix}:file:{{{file_id}}}"


def tenant_files(prefix: str, tenant: str) -> str:
    """Sorted set: a tenant's file ids by creation time (GET /v1/files); an id whose file expired is
    dropped when the list is read."""
    return f"{prefix}:files:{{{tenant}}}"


# arq's keys: the queue (a sorted set) and `<queue>:health-check`; per job `arq:job:<id>`,
# `arq:in-progress:<id>`, `arq:result:<id>`, `arq:retry:<id>`; and its fixed abort set
# `arq:abort`, which every job's finishing MULTI touches (even with aborts off). Its MULTIs and
# WATCHes span a job's keys, the queue and that set, and a Redis Cluster runs each on one slot:
# so the queue name and every job id (and cron job name, from which arq builds cron job ids)
# begin with this tag, which puts them all in `arq:abort`'s slot.
ARQ_TAG = "{arq:abort}"


def arq_queue(prefix: str) -> str:
    """The scheduler's arq job queue (batch jobs, cron jobs)."""
    return f"{ARQ_TAG}:{prefix}:arq"


def arq_job_id(prefix: str, name: str) -> str:
    """An arq job id, or a cron job's name, in the queue's slot (ARQ_TAG); the prefix keeps two
    deployments on one Redis from sharing a cron run's id (arq's `<name>:<ms>`)."""
    return f"{ARQ_TAG}:{prefix}:{name}"


def api_keys(prefix: str) -> str:
    """Hash: sha256 of an api key -> its tenant, name and creation time, as JSON (never the key)."""
    return f"{prefix}:apikeys"


def tenant_limits(prefix: str, tenant: str) -> str:
    """Hash: a tenant's limits (rpm, tpm, concurrent); 0 or absent means no limit."""
    return f"{prefix}:limits:{{{tenant}}}"


def tenant_usage(prefix: str, tenant: str, kind: str) -> str:
    """Sorted set of a tenant's recent requests ('rpm', 'tpm') or its unfinished ones ('active')."""
    return f"{prefix}:usage:{{{tenant}}}:{kind}"


def tenant_streams(prefix: str, tenant: str) -> str:
    """Sorted set: a tenant's open SSE streams, over every replica (api/core/stream_slots.py), each
    scored with the ms (Redis's clock) its lease ends. No member outlives its lease unrenewed, and
    the set expires a lease after its last take or renewal, so a dead replica's slots lapse."""
    return f"{prefix}:streams:{{{tenant}}}"
