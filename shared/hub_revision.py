"""A hub model's revision (STREAMQ_MODEL_REVISION) pinned to one commit per deployment, recorded in
Redis by the first process that resolves it, so the api and every worker load one snapshot
whatever their start order and machine."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import uuid
from pathlib import Path

from shared import redis_keys
from shared.model_source import ModelNotFound
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

_COMMIT = re.compile(r"^[0-9a-f]{40}$")

# (redis url, prefix, repo, revision) -> commit: each process asks Redis once per model.
_commits: dict[tuple[str, str, str, str], str] = {}
_commits_lock = threading.Lock()


def hub_commit(settings: CommonSettings, repo: str) -> str:
    """The commit of `repo` this deployment serves: STREAMQ_MODEL_REVISION when it is a commit;
    else the commit the deployment's first process resolved it to, which it recorded in Redis
    (SET NX, so two first processes agree too); else resolved now and recorded."""
    revision = settings.model_revision
    if _COMMIT.match(revision):
        return revision
    memo = (settings.redis_url, settings.prefix, repo, revision)
    with _commits_lock:
        if memo not in _commits:
            _commits[memo] = _agreed_commit(settings, repo, revision)
        return _commits[memo]


def _agreed_commit(settings: CommonSettings, repo: str, revision: str) -> str:
    key = redis_keys.model_commit(settings.prefix, repo, revision)
    try:
        pinned = _pin(settings.redis_url, key, None)
        if pinned is None:
            pinned = _pin(settings.redis_url, key, _resolve(repo, revision))
    except ModelNotFound:
        raise
    except Exception as exc:  # noqa: BLE001 - Redis away: this process alone decides
        commit = _resolve(repo, revision)
        log.warning("model %s: could not read or record its commit in Redis (%s: %s); using %s, which the "
                    "other processes may not share", repo, type(exc).__name__, exc, commit)
        return commit
    log.info("model %s revision %s: commit %s, shared by the deployment (Redis key %s; delete it to follow "
             "the revision's new commits at the next start, or set STREAMQ_MODEL_REVISION to a commit)",
             repo, revision, pinned, key)
    return pinned


def _pin(url: str, key: str, commit: str | None) -> str | None:
    """GET `key`; with a commit, SET NX it first. Through the project's client (TLS, cluster), in a
    thread of its own, since the caller may be inside an event loop (the api's lifespan)."""
    from shared.redis_client import connect

    async def run() -> str | None:
        redis = connect(url)
        try:
            if commit is not None:
                await redis.set(key, commit, nx=True)
            return await redis.get(key)
        finally:
            await redis.aclose()
    result: list = []

    def in_thread() -> None:
        try:
            result.append(asyncio.run(asyncio.wait_for(run(), timeout=10)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result.append(exc)
    thread = threading.Thread(target=in_thread, name="model-commit")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _resolve(repo: str, revision: str) -> str:
    """The commit `revision` of `repo` is at now: asked of the hub, else from the local cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs" / revision
    try:
        commit = HfApi().model_info(repo, revision=revision).sha
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelNotFound(
            f"the hub at {constants.ENDPOINT} has no model {repo!r} at revision {revision!r} "
            f"({type(exc).__name__}): check the id and STREAMQ_MODEL_REVISION; a private or gated "
            "repo needs HF_TOKEN") from exc
    except Exception as exc:  # no hub in reach: the local cache may know the revision
        if ref.is_file():
            commit = ref.read_text().strip()
            log.warning("the hub is out of reach (%s); model %s revision %s: commit %s from the local cache",
                        type(exc).__name__, repo, revision, commit)
            return commit
        raise ModelNotFound(unreachable(repo, f"revision {revision}", exc)) from exc
    # As huggingface_hub records a revision it resolved (we download by commit, so it does not):
    # a later start with no hub in reach finds the revision's commit in the cache.
    with contextlib.suppress(OSError):
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(f".{ref.name}.{uuid.uuid4().hex}")
        partial.write_text(commit)
        partial.replace(ref)
    return commit


def unreachable(repo: str, which: str, exc: BaseException) -> str:
    """What to do when `repo` is neither in the cache nor in reach: the words of every such failure."""
    from huggingface_hub import constants

    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"model {repo!r} ({which}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and the hub at {constants.ENDPOINT} is out of reach ({reason}). Give this machine access to the "
            f"hub (HF_ENDPOINT for a mirror, HF_TOKEN for a private repo); or run `STREAMQ_MODEL={repo} streamq "
            "prepare-model` where it is in reach and copy the cache (HF_HOME); or set STREAMQ_MODEL to a local "
            "folder or .gguf file")

