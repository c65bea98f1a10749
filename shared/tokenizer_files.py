"""A served model's tokenizer files: their names (once, for every use), written from a GGUF's
metadata or a folder without tokenizer.json (in a child process for the api, which never imports
transformers), and shared through Redis.

A worker publishes the files the api needs (tokenizer, chat template, context length, EOS) when
it starts; an api replica asked for a model it has not loaded fetches them into its cache
folder and loads a Tokenizer from there. So one api serves every model that has a live worker,
with no shared file system.
"""
from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from redis.asyncio import Redis

from shared import pooling_model, redis_keys, vision_model
from shared.atomic_folder import atomic_folder
from shared.model_source import ModelNotFound

log = logging.getLogger(__name__)

# What the api's Tokenizer (shared/tokenizer.py) reads of a tokenizer, and of the model's config
# (context length, EOS ids): the files a worker publishes.
API = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CONFIG = ("config.json", "generation_config.json")
FILES = API + CONFIG + (pooling_model.PUBLISHED, *vision_model.FILES)
# The tokenizer as transformers saves it (vLLM reads the special tokens' map too): what goes beside
# weights written into a folder of their own.
TOKENIZER = (*API, "special_tokens_map.json")
# What transformers builds tokenizer.json from where a repo has none, and an older chat template's file.
SOURCES = ("tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json")
# What sentence-transformers reads of an encoder's repo, but its modules' weights (shared/pooling_model.py).
SENTENCE_TRANSFORMERS = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
                         "*_Pooling/config.json", "*_Dense/config.json")
# What the api needs of a hub repo.
HUB = CONFIG + TOKENIZER + SOURCES + SENTENCE_TRANSFORMERS + vision_model.FILES


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


async def publish(redis: Redis, prefix: str, model: str, folder: Path) -> None:
    files = {name: (folder / name).read_text() for name in FILES if (folder / name).is_file()}
    if "tokenizer.json" not in files:  # e.g. the null backend, which needs no model
        return
    if (encoder := pooling_model.read(folder)) is not None:  # what an embedding model or cross-encoder computes
        files[pooling_model.PUBLISHED] = encoder.to_json()
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
    """The scalar and string entries of a GGUF file's header, and its numeric arrays of up to 16
    items (longer arrays skipped), read without numpy or transformers and without reading past the
    header: context length, token ids, chat template, an mmproj's image mean and std."""
    with path.open("rb") as f:
        def read(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def value(kind: int):
            if kind == 8:
                return f.read(read("<Q")).decode("utf-8", "replace")
            if kind != 9:
                return read(_GGUF_SCALARS[kind])
            item, count = read("<I"), read("<Q")
            if item in _GGUF_SCALARS and count <= 16:
                return [read(_GGUF_SCALARS[item]) for _ in range(count)]
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
    from shared import gguf_encoder

    meta = gguf_metadata(gguf)
    if gguf_encoder.is_encoder(meta):  # llama.cpp's bert / nomic-bert: a sentence-transformers folder
        gguf_encoder.write_description(gguf, folder)
        return
    from transformers import AutoTokenizer  # never in the api's process

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
    for name in CONFIG:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def build(writer: Callable[[Path, Path], None], source: Path, target: Path, in_child: bool) -> None:
    """Write the tokenizer folder `target` from `source` with `writer` (write_from_gguf or
    write_from_folder), whole or not at all; `in_child`: in a child process, so this one (the api)
    never imports transformers."""
    log.info("writing the tokenizer of %s into %s (once%s)", source.name, target,
             ", in a child process" if in_child else "")
    with atomic_folder(target, whole=has_tokenizer) as partial:
        if not in_child:
            writer(source, partial)
        else:
            code = ("import sys; from pathlib import Path; from shared import tokenizer_files as t; "
                    "getattr(t, sys.argv[1])(Path(sys.argv[2]), Path(sys.argv[3]))")
            done = subprocess.run([sys.executable, "-c", code, writer.__name__, str(source), str(partial)],
                                  capture_output=True, text=True)
            if done.returncode or not has_tokenizer(partial):
                tail = "\n".join(done.stderr.strip().splitlines()[-5:])
                raise ModelNotFound(f"could not build the tokenizer of {source} (`streamq prepare-model` "
                                    f"shows why):\n{tail}")
