"""The FastAPI application of one api replica. It never imports torch or loads weights."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis.asyncio import Redis

from api.hub import PubSubHub
from api.relay import Relay
from api.routes import health, requests
from shared import keys
from shared.models import model_dir, served_name
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


def create_app(settings: ApiSettings, tokenizer: Tokenizer | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = Redis.from_url(settings.redis_url, decode_responses=True)
        hub = PubSubHub(redis, keys.replica_channel(settings.prefix, settings.replica))
        await hub.start()
        store = RequestStore(redis, settings.prefix)
        app.state.settings = settings
        app.state.tokenizer = tokenizer or Tokenizer(model_dir(settings))
        app.state.model_name = served_name(settings)
        app.state.store = store
        app.state.hub = hub
        app.state.relay = Relay(store, hub, settings.sse_keepalive_s)
        try:
            yield
        finally:
            await hub.close()
            await redis.aclose()

    app = FastAPI(title="streamq", version="0.1.0", lifespan=lifespan)
    app.include_router(requests.router)
    app.include_router(health.router)
    return app
