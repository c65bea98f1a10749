"""A hub model's files, downloaded into the Hugging Face cache at the deployment's commit
(shared/hub_revision.py), or found there with no network."""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from shared import tokenizer_files
from shared.hub_revision import hub_commit, unreachable
from shared.model_source import ModelNotFound
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

# What the api needs of a hub repo, and what a worker needs besides: safetensors only, so no
# .bin duplicates, other GGUFs or consolidated checkpoints (.bin only where a repo has no safetensors).
TOKENIZER_FILES = list(tokenizer_files.HUB)
WEIGHT_FILES = TOKENIZER_FILES + ["model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
                                  "*_Dense/model.safetensors"]  # an embedding model's Dense layers
BIN_FILES = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"]


def hub_snapshot(settings: CommonSettings, repo: str, files: list[str]) -> Path:
    """The snapshot folder of the deployment's commit of `repo`, with those of `files` it has."""
    from huggingface_hub import snapshot_download

    commit = hub_commit(settings, repo)
    with contextlib.suppress(Exception):  # every file in the cache: no network, no log
        return Path(snapshot_download(repo, revision=commit, allow_patterns=files, local_files_only=True))
    _probe(repo, commit, settings.model_revision)
    log.info("model %s: downloading commit %s's %s into the Hugging Face cache", repo, commit,
             "weights and tokenizer" if files is not TOKENIZER_FILES else "tokenizer and config")
    start = time.monotonic()
    try:
        folder = Path(snapshot_download(repo, revision=commit, allow_patterns=files))
    except Exception as exc:  # reported as a start-up failure that says what to do
        raise ModelNotFound(unreachable(repo, f"revision {settings.model_revision}, commit {commit}", exc)) from exc
    log.info("model %s: downloaded into %s in %.1f s", repo, folder, time.monotonic() - start)
    return folder


def hub_weights(settings: CommonSettings, repo: str) -> Path:
    """The snapshot folder with `repo`'s config, tokenizer and weights (.bin where it has no safetensors)."""
    folder = hub_snapshot(settings, repo, WEIGHT_FILES)
    if not any(folder.glob("*.safetensors")):
        log.info("model %s has no safetensors: fetching its .bin weights", repo)
        folder = hub_snapshot(settings, repo, BIN_FILES)
    return folder


def hub_file(settings: CommonSettings, repo: str, name: str) -> Path:
    """One file of `repo` (a GGUF), from the cache or downloaded."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import RemoteEntryNotFoundError

    commit = hub_commit(settings, repo)
    if isinstance(cached := try_to_load_from_cache(repo, name, revision=commit), str):
        return Path(cached)
    _probe(repo, commit, settings.model_revision)
    log.info("model %s: downloading %s of commit %s into the Hugging Face cache", repo, name, commit)
    try:
        return Path(hf_hub_download(repo, name, revision=commit))
    except RemoteEntryNotFoundError as exc:
        raise ModelNotFound(f"the hub repo {repo!r} has no file {name!r} at commit {commit}: check the name "
                            f"after the ':' in STREAMQ_MODEL (a file of the repo, e.g. model.Q4_K_M.gguf)") from exc
    except Exception as exc:
        raise ModelNotFound(unreachable(f"{repo}:{name}", f"revision {settings.model_revision}, commit {commit}",
                                        exc)) from exc


def _probe(repo: str, commit: str, revision: str) -> None:
    """One quick request before a download: with no hub in reach, huggingface_hub retries each
    file's download for about 20 s before it gives up."""
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo, revision=commit)
    except Exception as exc:  # the same words as when resolving the revision failed
        raise ModelNotFound(unreachable(repo, f"revision {revision}, commit {commit}", exc)) from exc
