"""A served model's tokenizer files: written from a GGUF's metadata or a folder without
tokenizer.json (shared/model_paths.py puts them in place), and shared through Redis.

A worker publishes the files the api needs (tokenizer, chat template, context length, EOS) when
it starts; an api replica asked for a model it has not loaded fetches them into its cache
folder and loads a Tokenizer from there. So one api serves every model that has a live worker,
with no shared file system.
"""
from __future__ import annotations

import json
import shutil
import struct
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


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: Path) -> dict[str, object]:
    """The scalar and string entries of a GGUF file's header (arrays skipped), read without numpy
    or transformers and without reading past the header: context length, token ids, chat template."""
    with path.open("rb") as f:
        def read(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def value(kind: int):
            if kind == 8:
                return f.read(read("<Q")).decode("utf-8", "replace")
            if kind != 9:
                return read(_GGUF_SCALARS[kind])
            item, count = read("<I"), read("<Q")
            if item in _GGUF_SCALARS:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
            else:  # strings (a vocabulary) or nested arrays: one at a time
                for _ in range(count):
                    value(item)
            return None
        if f.read(4) != b"GGUF" or read("<I") not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file (version 2 or 3, little-endian)")
        _tensors, count = read("<Q"), read("<Q")
        meta = {}
        for _ in range(count):
            key = f.read(read("<Q")).decode("utf-8", "replace")
            if (entry := value(read("<I"))) is not None:
                meta[key] = entry
    return meta


def write_from_gguf(gguf: Path, folder: Path) -> None:
    """The tokenizer files of a GGUF file, from its metadata: tokenizer.json (transformers converts
    the vocabulary), the chat template, and config.json with the context length and EOS ids."""
    from transformers import AutoTokenizer  # never in the api's process

    meta = gguf_metadata(gguf)
    arch = str(meta.get("general.architecture", ""))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    if template := meta.get("tokenizer.chat_template"):
        (folder / "chat_template.jinja").write_text(str(template))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    config = {"gguf_file": gguf.name, "gguf_architecture": arch,
              "max_position_embeddings": meta.get(f"{arch}.context_length"),
              "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos[0] if eos else None}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": sorted(set(eos))}, indent=1))


def write_from_folder(source: Path, folder: Path) -> None:
    """tokenizer.json (and the rest) for a model folder that has none, e.g. only tokenizer.model."""
    from transformers import AutoTokenizer  # never in the api's process

    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
