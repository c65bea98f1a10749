"""The models this api serves: its own (loaded at start), and any other model that has a live
worker, loaded on first use from the tokenizer files the worker published (shared/model_files.py).

Each model has its own Generation (tokenizer, limits of its context) and backpressure on its
own request queue; requests name the model with `model`, and go to that model's workers.
"""
from __future__ import annotations

import asyncio

from api.backpressure import Backpressure
from api.generation import ApiError, Generation
from shared import model_files
from shared.queue import RequestQueue
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer
from shared.workers import live_workers


class Models:
    def __init__(self, default: Generation, settings: ApiSettings):
        self.default = default
        self.settings = settings
        self._loaded: dict[str, Generation] = {default.model_name: default}
        self._backpressure: list[Backpressure] = []
        self._lock = asyncio.Lock()

    async def get(self, name: str | None) -> Generation:
        """The model's Generation; 404 naming the served models when nobody serves `name`."""
        if name is None or name in self._loaded:
            return self._loaded[name or self.default.model_name]
        async with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            served = await self.served()
            folder = None
            if name in served:
                folder = await model_files.fetch(self.default.store.redis, self.settings.prefix, name,
                                                 self.settings.model_cache_dir)
            if folder is None:
                raise ApiError(404, f"model {name!r} is not served here; served models: {sorted(served)}",
                               param="model", code="model_not_found")
            self._loaded[name] = await self._generation(name, Tokenizer(folder))
            return self._loaded[name]

    async def served(self) -> set[str]:
        """Models with a live worker. (This api's own model takes requests even before its
        worker is up: they wait in its queue, as at start-up.)"""
        live = await live_workers(self.default.store.redis, self.settings.prefix)
        return {w["model"] for w in live if w.get("model")}

    def loaded(self, name: str) -> Generation | None:
        return self._loaded.get(name)

    async def _generation(self, name: str, tokenizer: Tokenizer) -> Generation:
        base = self.default
        generation = Generation(base.store, base.relay, tokenizer, name, self.settings.default_max_tokens,
                                self.settings.queue_timeout_s)
        generation.max_tokens_cap, generation.log_prompts = base.max_tokens_cap, base.log_prompts
        generation.limits = base.limits
        backpressure = Backpressure(RequestQueue(base.store.redis, self.settings.prefix, name),
                                    self.settings.max_queued_requests)
        await backpressure.start()
        self._backpressure.append(backpressure)
        generation.backpressure = backpressure
        return generation

    async def close(self) -> None:
        for backpressure in self._backpressure:
            await backpressure.close()
