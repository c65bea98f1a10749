"""Where a model's files are, for each thing STREAMQ_MODEL may name (shared/model_source.py):

- a local folder: itself;
- a local `.gguf` file: its tokenizer, chat template and context length come from its metadata
  (a tokenizer folder in the cache); its weights are dequantised once into a safetensors folder
  in the cache (shared/gguf_convert.py), or read straight from the file by a loader that takes
  `gguf_file`;
- a hub id `org/name`: the files a causal LM needs, downloaded (shared/model_download.py) at the
  deployment's commit (shared/hub_revision.py);
- `org/name:file.gguf`: one GGUF file of a hub repo, then as a local `.gguf` file.

`model_dir` imports no torch or transformers (the api calls it: a tokenizer folder it lacks is
built in a child process); `prepare_model` may load weights once to convert them, and only the
worker and `streamq prepare-model` call it.
"""
from __future__ import annotations

import re
from pathlib import Path

from shared import mmproj, model_download, tokenizer_files
from shared.gguf_convert import convert_gguf, gguf_cache
from shared.model_source import ModelNotFound, source
from shared.settings import CommonSettings


def gguf_file(settings: CommonSettings) -> Path | None:
    """The model's GGUF file (downloaded first for org/name:file.gguf), for a loader that reads
    it directly; None for a model that is no GGUF."""
    src = source(settings)
    if src.kind == "gguf":
        return Path(src.where)
    if src.kind == "hub_gguf":
        return model_download.hub_file(settings, src.where, src.file)
    return None


def weights_dir(settings: CommonSettings) -> Path:
    """The folder holding the model's config and weights: a GGUF's is its dequantised copy in the
    cache (made by prepare_model); a hub model's is its snapshot, downloaded if need be."""
    src = source(settings)
    if src.kind == "folder":
        return Path(src.where)
    if src.kind == "hub":
        return model_download.hub_weights(settings, src.where)
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
            convert_gguf(gguf, gguf_cache(settings, gguf), folder, settings.mmproj)
        else:
            weights_dir(settings)
    return folder


def _tokenizer_dir(settings: CommonSettings, in_child: bool) -> Path:
    src = source(settings)
    if settings.mmproj is not None and (src.kind not in ("gguf", "hub_gguf") or not settings.mmproj.is_file()):
        raise ModelNotFound(f"STREAMQ_MMPROJ={settings.mmproj}: an mmproj is a local GGUF file served beside a GGUF "
                            "model (STREAMQ_MODEL=...gguf)" + ("" if settings.mmproj.is_file() else "; no such file"))
    if src.kind in ("gguf", "hub_gguf"):
        gguf = gguf_file(settings)
        weights = gguf_cache(settings, gguf)
        folder = weights.with_name(f"{weights.name}-tokenizer")
        if not tokenizer_files.has_tokenizer(folder):
            tokenizer_files.build(tokenizer_files.write_from_gguf, gguf, folder, in_child)
        if settings.mmproj is not None and not mmproj.described(folder):
            mmproj.describe(settings.mmproj, folder)
        return folder
    if src.kind == "folder":
        files, slug = Path(src.where), _slug(settings.model)
    else:
        files = model_download.hub_snapshot(settings, src.where, model_download.TOKENIZER_FILES)
        slug = f"{_slug(src.where)}-{files.name[:12]}"
    if tokenizer_files.has_tokenizer(files):
        return files
    folder = settings.model_cache_dir / f"{slug}-tokenizer"
    if not tokenizer_files.has_tokenizer(folder):
        tokenizer_files.build(tokenizer_files.write_from_folder, files, folder, in_child)
    return folder


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "--", text).strip("-")
