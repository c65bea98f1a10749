"""A served model's tokenizer files, shared through Redis.

A worker publishes the files the api needs (tokenizer, chat template, context length, EOS) when
it starts; an api replica asked for a model it has not loaded fetches them into its cache
folder and loads a Tokenizer from there. So one api serves every model that has a live worker,
with no shared file system.
"""
from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis

from shared import redis_keys

FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "chat_template.jinja")


async def publish(redis: Redis, prefix: str, model: str, folder: Path) -> None:
    files = {name: (folder / name).read_text() for name in FILES if (folder / name).is_file()}
    if "tokenizer.json" not in files:  # e.g. the null backend, which needs no model
        return
    key = redis_keys.model_files(prefix, model)
    async with redis.pipeline(transaction=False) as pipe:  # no MULTI: not on a Redis Cluster's async client
        pipe.hset(key, mapping=files)
        if stale := [name for name in FILES if name not in files]:  # another version of the model had it
            pipe.hdel(key, *stale)
        await pipe.execute()


async def fetch(redis: Redis, prefix: str, model: str, cache_dir: Path) -> Path | None:
    """The model's files in a folder under `cache_dir` (None when no worker published them)."""
    files = await redis.hgetall(redis_keys.model_files(prefix, model))
    if "tokenizer.json" not in files:
        return None
    folder = cache_dir / "served" / "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if name in FILES:
            (folder / name).write_text(text)
    return folder
