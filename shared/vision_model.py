"""What a vision-language model takes of an image, read from its folder without torch: the api
needs it to count a prompt's image tokens and to refuse images to a model that takes none.

Served here: LLaVA-1.5 (`model_type: llava`, a CLIP or SigLIP encoder and a projector; transformers'
LlavaForConditionalGeneration), whose every image is a fixed number of tokens: the encoder's
patches of the processor's crop, plus its CLS token unless the projector drops it
(`vision_feature_select_strategy: default`). Its processor puts that many image tokens where the
chat template writes one; the api does the same to the ids (`expand`), so the worker's input ids
are the processor's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llava",)
FILES = ("processor_config.json", "preprocessor_config.json")  # beside the tokenizer, published with it


class UnsupportedVision(ValueError):
    """A vision-language model this server does not serve (a family, a processor setting)."""


@dataclass(frozen=True)
class VisionModel:
    family: str
    image_token_id: int
    tokens_per_image: int

    def expand(self, ids: list[int], images: int) -> list[int]:
        """`ids` with each image token repeated tokens_per_image times; ValueError unless the
        prompt holds one image token per image (the chat template writes one per image part)."""
        found = ids.count(self.image_token_id)
        if found != images:
            raise ValueError(f"the prompt has {found} image tokens for {images} images: the chat template must write "
                             "one per image part (and a text part may not spell the image token)")
        out: list[int] = []
        for token in ids:
            out.extend([token] * self.tokens_per_image if token == self.image_token_id else [token])
        return out


def read(folder: Path) -> VisionModel | None:
    """The folder's vision-language model (None: a text model); UnsupportedVision where it is one
    this server does not serve."""
    config = _json(folder / "config.json")
    if "vision_config" not in config:
        return None
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedVision(f"vision-language models of type {family!r} are not served here ({', '.join(FAMILIES)} are)")
    processor = _json(folder / "processor_config.json")
    image = processor.get("image_processor") or _json(folder / "preprocessor_config.json")
    crop = image.get("crop_size") or {}
    patch = int(processor.get("patch_size") or config["vision_config"].get("patch_size") or 0)
    if not crop or not patch:
        raise UnsupportedVision(f"{folder}: the processor's crop size and patch size are needed to count image tokens")
    strategy = processor.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")
    count = (int(crop["height"]) // patch) * (int(crop["width"]) // patch) \
        + int(processor.get("num_additional_image_tokens", 0)) - (1 if strategy == "default" else 0)
    if config.get("image_seq_length") not in (None, count):
        raise UnsupportedVision(f"{folder}: the processor gives {count} tokens an image, the config "
                                f"{config['image_seq_length']}")
    return VisionModel(family, int(config["image_token_index"]), count)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
