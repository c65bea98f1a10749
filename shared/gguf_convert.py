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
    change (and its mmproj's, when one is served beside it), so a changed or replaced file is read
    again. Its tokenizer's folder adds '-tokenizer'."""
    files = [gguf] + ([settings.mmproj] if settings.mmproj is not None else [])
    stats = [(f, f.stat()) for f in files]
    text = "\0\0".join(f"{f.resolve()}\0{s.st_size}\0{s.st_mtime_ns}" for f, s in stats)
    return settings.model_cache_dir / f"{gguf.stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def converted(folder: Path) -> bool:
    """`folder` holds whole converted weights and their tokenizer."""
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    return weights and tokenizer_files.has_tokenizer(folder)


def convert_gguf(gguf: Path, target: Path, tokenizer_dir: Path, mmproj: Path | None = None) -> None:
    """Dequantise the GGUF's weights into a safetensors folder (fp32), with its tokenizer beside;
    with `mmproj`, the vision-language model the pair makes (its description in `tokenizer_dir`)."""
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
    if mmproj is not None:
        model = _with_vision(model, mmproj, tokenizer_dir)
    # Its own folder: pods sharing the cache volume convert at once, each as pid 1.
    with atomic_folder(target, whole=converted) as partial:
        model.save_pretrained(partial)
        for name in tokenizer_files.TOKENIZER + ("preprocessor_config.json", "processor_config.json"):
            if (tokenizer_dir / name).is_file():  # vLLM reads the tokenizer from the weights' folder
                shutil.copy(tokenizer_dir / name, partial / name)


def _with_vision(text_model, mmproj: Path, tokenizer_dir: Path):
    """The Gemma 3 with vision that a text GGUF's model and its mmproj make (shared/mmproj.py): the
    language model's weights and the mmproj's tower and projector in one transformers model."""
    import json

    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from shared import mmproj as pair

    described = json.loads((tokenizer_dir / "config.json").read_text())
    if text_model.config.model_type != "gemma3_text":
        raise pair.UnsupportedMmproj(f"an mmproj goes beside a Gemma 3 text GGUF, not a {text_model.config.model_type!r} one")
    config = Gemma3Config(text_config=text_model.config.to_dict(), vision_config=described["vision_config"],
                          **{k: described[k] for k in ("mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                                                       "image_token_index")})
    config.tie_word_embeddings = text_model.config.tie_word_embeddings
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    state = {("lm_head." + k[len("lm_head."):]) if k.startswith("lm_head.") else "model.language_model." + k[len("model."):]: v
             for k, v in text_model.state_dict().items()}
    state |= pair.vision_weights(mmproj, config.vision_config.num_hidden_layers)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
