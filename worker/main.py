"""Entry point of one worker process: load the model, then serve requests until stopped."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import torch

from shared.redis_client import ClusterUnsupported, connect, refuse_cluster, until_redis_answers

from shared import tokenizer_files, tracing
from shared.logs import route_transformers
from shared.model_paths import gguf_file, model_dir, prepare_model, weights_dir
from shared.model_source import ModelNotFound, served_name
from shared.prefix_scope import PrefixScope
from shared.redis_client import connect_blocking
from shared.settings import BatchingSettings, CacheSettings, StepSettings, WorkerSettings
from shared.tokenizer import Tokenizer, served_context
from worker.model import kernels, quant_model
from worker.engine.backend import Backend
from worker.engine.threaded import Threaded
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.drafter import DraftProposer
from worker.engine.core import Engine
from worker.engine.encoder_engine import EncoderEngine
from worker.model import encoders
from worker.engine.kv_tier import WEIGHT_FILES, KVTier, space_of, weights_fingerprint
from worker.model.lora import Adapters
from worker.model.forward_plan import supports
from worker.model.kv_cache import blocks_for_bytes
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model, load_weights, pick_device, pick_dtype
from worker.backends.null_engine import NullEngine
from worker.service.service import EngineStalled, WorkerService
from worker.engine.speculation import NgramProposer, Speculator
from worker.engine.vision import ImageEncoder, TextView
from worker.backends.static_engine import BatchRunner, StaticEngine
from worker.backends.vllm_backend import VllmBackend, VllmUnavailable, batch_invariant  # vLLM: imported only when chosen

log = logging.getLogger("streamq.worker")


def num_kv_blocks(cache: CacheSettings, batching: BatchingSettings, model, dtype) -> int:
    """From the setting, else as many as kv_cache_gb holds, but no more than a full batch can use."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    context = served_context(model.config.to_dict())
    useful = batching.batch_size * (-(-context // cache.block_size))
    return min(useful, blocks_for_bytes(model, dtype, cache.block_size, int(cache.kv_cache_gb * 2**30)))


# A request's KV working set the batch is sized for: a chat turn and its answer. A batch the
# cache cannot hold at that size would preempt in every busy step instead of running.
TOKENS_PER_REQUEST = 256
FLEX_BESIDE_PRIORITY_ON_CPU = 4  # the flex requests a step runs beside a decoding priority one (shared/settings.py)


def batch_for_cache(batching: BatchingSettings, cache: CacheSettings, blocks: int) -> int:
    """batch_size, lowered to the requests `blocks` cache blocks hold at TOKENS_PER_REQUEST each."""
    return max(1, min(batching.batch_size, blocks * cache.block_size // TOKENS_PER_REQUEST))


def build_engine(settings: WorkerSettings) -> Engine | EncoderEngine | StaticEngine | NullEngine:
    """One of the built-in engines (they step synchronously: the service runs them in a thread)."""
    batching, cache, step = settings.batching, settings.cache, settings.step
    if settings.backend == "null":
        log.info("null backend: no model, %.1f tokens/s per request", settings.null_tokens_per_s)
        return NullEngine(batching.batch_size, settings.null_tokens_per_s)
    tokenizer = Tokenizer(prepare_model(settings, weights=False))
    device = pick_device(step.device)
    if tokenizer.pooling is not None:
        return build_encoder(settings, tokenizer, device)
    dtype = pick_dtype(step.dtype, device)
    model = load_weights(settings, device, dtype)
    log.info("loaded %s (%s) on %s as %s", settings.model, model.config.model_type, device, dtype)
    images, processor = None, None
    if tokenizer.vision is not None:
        from transformers import AutoImageProcessor

        log.info("a vision-language model (%s): %d tokens an image at %s", tokenizer.vision.family,
                 tokenizer.vision.base_tokens, "its crop size, more by its tiles" if tokenizer.vision.pinpoints else "any size")
        processor = AutoImageProcessor.from_pretrained(weights_dir(settings))
        language = TextView(model)
        if supports(language):  # the paged runner runs the language model; the engine, the tower
            images, model = ImageEncoder(model, processor, tokenizer.vision), language
    if not supports(model):
        if step.deterministic:
            raise ValueError(f"deterministic mode needs the paged engine, which has no runner for "
                             f"model_type={model.config.model_type!r}")
        if settings.lora.paths:
            raise ValueError(f"LoRA adapters run on the paged engine, which has no runner for "
                             f"model_type={model.config.model_type!r}")
        log.warning("no paged runner for %s: using static batches (slower)", model.config.model_type)
        if settings.speculative.method != "off":
            log.warning("speculative decoding needs the paged engine: off for %s", model.config.model_type)
        pad = next(iter(tokenizer.eos_token_ids), 0)
        return StaticEngine(BatchRunner(model, device, pad_id=pad), tokenizer, batching.batch_size, processor)
    blocks = num_kv_blocks(cache, batching, model, dtype)
    batch = batch_for_cache(batching, cache, blocks)
    budget = max(batch, batching.max_num_batched_tokens)
    log.info("KV cache: %d blocks of %d tokens; batch of %d requests, %d tokens a step",
             blocks, cache.block_size, batch, budget)
    runner = PagedRunner(model, device, num_blocks=blocks, block_size=cache.block_size,
                         kernels=step_kernels(step, device),
                         graph_batch=batch if step.cuda_graphs and device.type == "cuda" else 0,
                         deterministic=step.deterministic)
    quant_model.release_projections(model)  # the runner's Weights hold them packed; a byte a code no more
    runner.adapters = build_adapters(settings, runner)
    log.info("step: %s%s%s; %s", "CPU step kernels" if runner.kernels is not None else
             "fused eager ops" if runner.fused is not None else "the modules' eager ops",
             f", decode from CUDA graphs (batch buckets {runner.graphs.batches})" if runner.graphs else "",
             ", deterministic" if runner.deterministic else "",
             "each token computed alone: a continuation after a failover, a prefix-cache hit and speculation "
             "give the undisturbed tokens" if runner.batch_invariant else
             "a token's rounding depends on its batch: a continuation after a failover may part from the "
             "undisturbed text at a near-tie (STREAMQ_DETERMINISTIC=true makes it exact; docs/reliability.md)")
    blocks_manager = BlockManager(blocks, cache.block_size, prefix_caching=cache.prefix_caching)
    batcher = Batcher(blocks_manager, max_num_seqs=batch, max_num_batched_tokens=budget,
                      flex_beside_priority=flex_beside_priority(batching, device))
    return Engine(runner, tokenizer, batcher, build_speculator(settings, runner, tokenizer),
                  build_tier(settings, runner), PrefixScope.parse(settings.shared_prefix_tenants), images)


def flex_beside_priority(batching: BatchingSettings, device) -> int | None:
    """The setting, or where unset: 4 on a CPU (2 to 4 brought a priority chat's TTFT p99 beside a flex
    flood from 2.3 times its p99 alone to 1.0 on 2 cores, docs/benchmarks.md), no cap elsewhere."""
    if batching.flex_beside_priority is not None:
        return batching.flex_beside_priority
    return FLEX_BESIDE_PRIORITY_ON_CPU if device.type == "cpu" else None


def build_encoder(settings: WorkerSettings, tokenizer: Tokenizer, device) -> EncoderEngine:
    """The engine of an embedding model or a cross-encoder (shared/pooling_model.py). dtype auto on
    a CPU keeps the weights, norms and residual stream in fp32 and computes the matmuls in bf16
    where the CPU has fast bf16 (all in fp32 elsewhere): an embedding is read as a value, and
    this keeps it within a cosine of 0.99998 of sentence-transformers' fp32 on all-MiniLM-L6-v2."""
    step, batching = settings.step, settings.batching
    for name, value, default in (("quantization", step.quantization, "none"),
                                 ("speculative_method", settings.speculative.method, "off")):
        if value != default:
            raise ValueError(f"{name}={value}: an encoder model runs on the built-in engine with {name}={default}")
    if settings.lora.paths or settings.lora.enable:
        raise ValueError("LoRA adapters are served on decoder models; this one is an encoder")
    if gguf_file(settings) is not None:  # llama.cpp's bert / nomic-bert: dequantised once (shared/gguf_encoder.py)
        prepare_model(settings, weights=True)
    dtype, matmuls = pick_dtype(step.dtype, device), None
    if step.dtype == "auto" and device.type == "cpu" and dtype != torch.float32:
        dtype, matmuls = torch.float32, dtype
    encoder = encoders.load(weights_dir(settings), tokenizer.pooling, device, dtype, matmuls)
    log.info("loaded %s: a %s %s (%s) on %s in %s; %d inputs, %d tokens a step", settings.model, encoder.family,
             "cross-encoder" if tokenizer.pooling.kind == "classify" else "embedding model",
             ", ".join(tokenizer.pooling.modes) if tokenizer.pooling.kind == "embed" else tokenizer.pooling.activation,
             device, encoder.numerics, batching.batch_size, batching.max_num_batched_tokens)
    return EncoderEngine(encoder, tokenizer, batching.batch_size, batching.max_num_batched_tokens)


def build_adapters(settings: WorkerSettings, runner: PagedRunner) -> Adapters | None:
    """The LoRA adapters of lora_modules, the first max_loras of them loaded now (the rest on
    first use); None where none are configured. A ValueError names one that cannot be served."""
    lora = settings.lora
    paths = lora.paths
    if not paths and not lora.enable:
        return None
    # Deterministic mode: the deltas' matmuls in fixed tiles, as the projections' (batch_invariant holds).
    adapters = Adapters(runner.model, lora.max_loras, lora.max_rank, paths,
                        runner.plan.tile, runner.kernels)
    for name, path in list(paths.items())[:lora.max_loras]:
        adapter = adapters.load(name, path)
        log.info("LoRA adapter %s: r=%d, scale %.3g, on %s (%s)", name, adapter.rank, adapter.scale,
                 ",".join(sorted(adapter.targets)), path)
    return adapters


def build_tier(settings: WorkerSettings, runner: PagedRunner) -> KVTier | None:
    """The shared KV tier, where on, in the space of the workers that compute the same bits: the
    same weights, quantization, block size, dtype and kernels (PagedRunner.numerics)."""
    cache, step = settings.cache, settings.step
    if not cache.kv_tier:
        return None
    if not cache.prefix_caching:
        log.info("shared KV tier: off (it shares the prefix cache's blocks, and prefix_caching is off)")
        return None
    gguf = gguf_file(settings)
    files = [gguf] if gguf is not None else [p for pattern in WEIGHT_FILES for p in weights_dir(settings).glob(pattern)]
    space = space_of(weights_fingerprint(files), runner.model.config.model_type, step.quantization,
                     step.gguf_weights, cache.block_size, *runner.numerics)
    url = cache.kv_redis_url or settings.redis_url
    tier = KVTier(connect_blocking(url, cache.kv_tier_timeout_ms / 1000), settings.prefix, space,
                  runner.block_kv_bytes, int(cache.kv_tier_gb * 2**30), cache.kv_tier_ttl_s)
    log.info("shared KV tier: space %s, %.0f KiB a block, up to %.1f GiB for %.0f s after last use%s",
             space, runner.block_kv_bytes / 1024, cache.kv_tier_gb, cache.kv_tier_ttl_s,
             "" if cache.kv_redis_url is None else " (its own Redis)")
    return tier


def step_kernels(step: StepSettings, device):
    """The compiled CPU step kernels for a CPU worker (built on first use, then cached), or None."""
    if device.type != "cpu" or not step.cpu_kernels:
        return None
    return kernels.load(step)


def build_speculator(settings: WorkerSettings, target: PagedRunner, tokenizer: Tokenizer) -> Speculator | None:
    spec = settings.speculative
    k = spec.num_tokens
    if spec.method == "off":
        return None
    if spec.method == "ngram":
        log.info("speculative decoding: prompt lookup, up to %d tokens, n-grams %d..%d",
                 k, spec.ngram_min, spec.ngram_max)
        return Speculator(NgramProposer(k, spec.ngram_min, spec.ngram_max), k, spec.disable_by_batch_size)
    draft_settings = settings.model_copy(update={"model": spec.model})
    draft_tokenizer = Tokenizer(prepare_model(draft_settings))
    if draft_tokenizer.vocabulary() != tokenizer.vocabulary():
        raise ValueError(f"the draft model {spec.model!r} has another tokenizer than "
                         f"{settings.model!r}; speculative decoding needs the same one")
    model = load_model(weights_dir(draft_settings), target.device, next(target.model.parameters()).dtype)
    if not supports(model):
        raise ValueError(f"no paged runner for the draft model's model_type={model.config.model_type!r}")
    log.info("speculative decoding: draft model %s (%s), up to %d tokens", spec.model,
             model.config.model_type, k)
    # In deterministic mode a sampled request takes no draft proposals: the draft's acceptance
    # rule draws from the request's random stream in another order than plain sampling does.
    return Speculator(DraftProposer.beside(target, model), k, spec.disable_by_batch_size,
                      draft_sampled=not settings.step.deterministic)


async def build_backend(settings: WorkerSettings) -> Backend:
    if settings.backend == "vllm":
        VllmBackend.require_vllm()  # before any model work: say at once what is missing
        if settings.step.deterministic:
            batch_invariant()
        tokenizer = Tokenizer(await asyncio.to_thread(prepare_model, settings))
        return await VllmBackend.start(settings, str(weights_dir(settings)), tokenizer)
    return await Threaded.build(lambda: build_engine(settings), settings.backend)


async def serve(settings: WorkerSettings) -> None:
    try:
        engine = await build_backend(settings)
    except (VllmUnavailable, ValueError, ModelNotFound) as exc:  # settings this worker cannot serve: say why, once
        log.critical("%s", exc)
        raise SystemExit(2) from exc
    redis = connect(settings.redis_url)
    try:
        await until_redis_answers("start", lambda: refuse_cluster(redis), log)
    except ClusterUnsupported as exc:
        log.critical("%s", exc)
        raise SystemExit(2) from exc
    await until_redis_answers("model files", lambda: tokenizer_files.publish(
        redis, settings.prefix, served_name(settings), model_dir(settings)), log)
    tracing.configure("streamq-worker")
    log.info("execution plan: %s", engine.plan.describe())
    service = WorkerService(redis, engine, settings, served_name(settings))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    log.info("worker %s serving %s (batch_size=%d)", settings.worker_name, served_name(settings), settings.batch_size)
    try:
        await service.run()
    except EngineStalled:
        # The stuck step's thread cannot be stopped, and asyncio.run would wait for it forever.
        log.critical("exiting: the engine is stuck; the supervisor restarts this worker")
        logging.shutdown()
        os._exit(3)
    finally:
        tracing.shutdown()
        await redis.aclose()
        await engine.close()


def main(settings: WorkerSettings | None = None) -> None:
    route_transformers()
    asyncio.run(serve(settings or WorkerSettings()))
