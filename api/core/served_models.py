"""The models this api serves: its own (loaded at start), and any other model that has a live
worker, loaded on first use from the tokenizer files the worker published (shared/tokenizer_files.py).

Each model has its own Generation (tokenizer, limits of its context) and backpressure on its
own request queue; requests name the model with `model`, and go to that model's workers.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from api.core import images
from api.core.backpressure import Backpressure
from api.core.errors import ApiError
from api.core.generation import Generation
from api.core.grammar_pool import GrammarPool
from api.core.limits import Limits
from api.core.parsers import reasoning, registry
from api.core.metrics import ApiMetrics
from api.core.relay import Relay
from api.core.tokenize_pool import TokenizePool
from shared import tokenizer_files
from shared.lora_registry import AdapterEntry, LoraRegistry
from shared.prefix_affinity import PrefixAffinity
from shared.prefix_scope import PrefixScope
from shared.queue import RequestQueue
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer
from shared.workers import live_workers


@dataclass
class Adapter:
    """A LoRA adapter some live worker serves."""

    base: str  # its base model
    backends: set[str]  # of the workers that list it
    entry: AdapterEntry | None = None  # where it was loaded at run time (its folder, its tenants)


class Models:
    """Every model's Generation, built the same way: this api's own at start (`add`), any other
    on its first request (`get`)."""

    def __init__(self, store: RequestStore, relay: Relay, settings: ApiSettings, limits: Limits | None,
                 metrics: ApiMetrics | None = None, grammars: GrammarPool | None = None,
                 tokenizing: TokenizePool | None = None):
        """`grammars`, `tokenizing`: the replica's pools for every model's CPU work (none: from the settings)."""
        self.store = store
        self.relay = relay
        self.settings = settings
        self.limits = limits
        self.metrics = metrics
        self.grammars = grammars or GrammarPool(settings.api_cpu_workers, settings.compile_timeout_s)
        self.tokenizing = tokenizing or TokenizePool(settings.api_cpu_workers, settings.tokenize_timeout_s)
        self.default: Generation | None = None  # the first model added: requests without `model`
        self._loaded: dict[str, Generation] = {}
        self._backpressure: list[Backpressure] = []
        self._lock = asyncio.Lock()

    async def add(self, name: str, tokenizer: Tokenizer) -> Generation:
        """Serve `name` with this tokenizer (its limits and backpressure from the settings)."""
        settings = self.settings
        queued = self.metrics.queued.labels(name).set if self.metrics is not None else None
        backpressure = Backpressure(RequestQueue(self.store.redis, settings.prefix, name), settings.max_queued_requests,
                                    on_backlog=queued)
        await backpressure.start()
        self._backpressure.append(backpressure)
        generation = Generation(self.store, self.relay, tokenizer, name, default_max_tokens=settings.default_max_tokens,
                                queue_timeout_s=settings.queue_timeout_s, flex_queue_timeout_s=settings.flex_queue_timeout_s,
                                max_tokens_cap=settings.max_tokens_cap,
                                backpressure=backpressure, limits=self.limits, log_prompts=settings.log_prompts,
                                affinity=PrefixAffinity(self.store.redis, settings.prefix, name,
                                                        settings.prefix_affinity_tokens,
                                                        PrefixScope.parse(settings.shared_prefix_tenants))
                                if settings.prefix_affinity else None,
                                tool_format=registry.choose(settings.tool_parser, name, tokenizer),
                                reasoning=reasoning.choose(settings.reasoning_parser, name, tokenizer),
                                grammars=self.grammars, tokenizing=self.tokenizing,
                                image_limits=images.Limits.of(settings))
        self._loaded[name] = generation
        self.default = self.default or generation
        return generation

    async def sample_backlogs(self) -> None:
        """Every served model's backlog read now, into the queued-requests gauge."""
        for backpressure in self._backpressure:
            await backpressure.sample()

    async def get(self, name: str | None) -> Generation:
        """The model's Generation; 404 naming the served models when nobody serves `name`."""
        if name is None:
            return self.default
        if name in self._loaded:
            return self._loaded[name]
        async with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            adapters = await self.adapters()
            if name in adapters:  # a LoRA adapter: its base model's Generation, the adapter on its requests
                adapter = adapters[name]
                generation = self._loaded.get(adapter.base)
                if generation is None:
                    generation = await self._load(adapter.base, await self.served())
                return generation.with_adapter(name, adapter.backends)
            return await self._load(name, await self.served())

    async def _load(self, name: str, served: set[str]) -> Generation:
        """A served model's Generation, from the tokenizer files its workers published."""
        folder = None
        if name in served:
            folder = await tokenizer_files.fetch(self.store.redis, self.settings.prefix, name,
                                                 self.settings.model_cache_dir)
        if folder is None:
            raise ApiError(404, f"model {name!r} is not served here; served models: {sorted(served)}",
                           param="model", code="model_not_found")
        return await self.add(name, Tokenizer(folder))

    async def adapters(self) -> dict[str, Adapter]:
        """The LoRA adapters served, name -> its base model, the backends of the workers that list it,
        and its run-time entry where it has one:
        those a live worker lists (STREAMQ_LORA_MODULES, and those loaded at run time once the
        worker has read them: until then a request would find no worker that knows its folder)."""
        live = await live_workers(self.store.redis, self.settings.prefix)
        found: dict[str, Adapter] = {}
        for worker in live:
            for name in worker.adapters:
                found.setdefault(name, Adapter(worker.model, set())).backends.add(worker.backend)
        registry = LoraRegistry(self.store.redis, self.settings.prefix)
        for model in {adapter.base for adapter in found.values()}:
            for name, entry in (await registry.entries(model)).items():
                if name in found:
                    found[name].entry = entry
        return found

    async def served(self) -> set[str]:
        """Models with a live worker. (This api's own model takes requests even before its
        worker is up: they wait in its queue, as at start-up.)"""
        live = await live_workers(self.store.redis, self.settings.prefix)
        return {w.model for w in live if w.model}

    def loaded(self, name: str) -> Generation | None:
        return self._loaded.get(name)

    async def close(self) -> None:
        for backpressure in self._backpressure:
            await backpressure.close()
        await self.grammars.close()
        self.tokenizing.close()
