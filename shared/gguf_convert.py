"""A GGUF file's weights dequantised once into a safetensors folder in the model cache, which then
loads in about 1 s instead of about 20 s (the default model's)."""
from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

from shared import gguf_encoder, tokenizer_files
from shared.atomic_folder import atomic_folder
from shared.settings import CommonSettings

log = logging.getLogger(__name__)


def gguf_cache(settings: CommonSettings, gguf: Path) -> Path:
    """The dequantised copy's folder, named for the file and keyed by its path, size and time of
    change, so a changed or replaced file is read again. Its tokenizer's folder adds '-tokenizer'."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return settings.model_cache_dir / f"{gguf.stem}-{key}"


def converted(folder: Path) -> bool:
    """`folder` holds whole converted weights and their tokenizer."""
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    return weights and tokenizer_files.has_tokenizer(folder)


def convert_gguf(gguf: Path, target: Path, tokenizer_dir: Path) -> None:
    """Dequantise the GGUF's weights into a safetensors folder (fp32), with its tokenizer beside."""
    if converted(target):
        return
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    if gguf_encoder.is_encoder(tokenizer_files.gguf_metadata(gguf)):
        with atomic_folder(target, whole=converted) as partial:
            shutil.copytree(tokenizer_dir, partial)  # the tokenizer and the sentence-transformers modules
            gguf_encoder.write_weights(gguf, partial)
        return
    import torch  # heavy, worker side only
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Its own folder: pods sharing the cache volume convert at once, each as pid 1.
    with atomic_folder(target, whole=converted) as partial:
        model.save_pretrained(partial)
        for name in tokenizer_files.TOKENIZER:
            if (tokenizer_dir / name).is_file():  # vLLM reads the tokenizer from the weights' folder
                shutil.copy(tokenizer_dir / name, partial / name)
