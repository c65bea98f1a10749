"""What a vision-language model takes of an image, read from its folder without torch: the api
needs it to count a prompt's image tokens and to refuse images to a model that takes none.

Served here (transformers' classes in brackets):
- LLaVA-1.5 (`model_type: llava`, a CLIP or SigLIP encoder and a projector;
  LlavaForConditionalGeneration), whose every image is a fixed number of tokens: the encoder's
  patches of the processor's crop, plus its CLS token unless the projector drops it
  (`vision_feature_select_strategy: default`).
- LLaVA-NeXT (`model_type: llava_next`; LlavaNextForConditionalGeneration), "anyres": the image is
  resized to the best of the processor's grid pinpoints and cut into tiles of the crop size, and
  its tokens are the base image's, then the tiles' patches with the padding taken off, a newline
  token ending each row. How many depends on the image's size (`tokens`).
- Qwen2-VL and Qwen2.5-VL (`model_type: qwen2_vl`, `qwen2_5_vl`; Qwen2VLForConditionalGeneration
  and Qwen2_5_VLForConditionalGeneration), dynamic resolution: the image is resized to multiples
  of the patch times the merge, its pixels kept within the processor's bounds, and each merge ×
  merge square of patches is one token. Their positions are M-RoPE's (time, height, width), built
  from the images in the worker (worker/engine/vision.py).
- Gemma 3 (`model_type: gemma3`; Gemma3ForConditionalGeneration): a SigLIP tower whose patches
  are pooled to `mm_tokens_per_image` soft tokens at any size. Its chat template writes
  <start_of_image>, and its processor writes that out in the text as "\n\n<start_of_image>", the
  soft tokens, "<end_of_image>\n\n" before tokenizing (`frame`: the tokenizer does the same,
  shared/tokenizer.py). An image's tokens attend to each other both ways (the paged forwards'
  attention lets them: worker/model/runner_inputs.py).

The processor puts that many image tokens where the chat template writes one; the api does the
same to the ids (`expand`), so the worker's input ids are the processor's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")
FILES = ("processor_config.json", "preprocessor_config.json")  # beside the tokenizer, published with it


class UnsupportedVision(ValueError):
    """A vision-language model this server does not serve (a family, a processor setting)."""


@dataclass(frozen=True)
class VisionModel:
    family: str
    image_token_id: int
    base_tokens: int  # the tokens of the image at the crop size (LLaVA-1.5: all of them)
    crop: tuple[int, int] = (0, 0)  # (height, width) of the processor's crop: a tile's size (LLaVA-NeXT)
    patch: int = 0  # the encoder's patch, in pixels
    pinpoints: tuple[tuple[int, int], ...] = ()  # (height, width) the processor may resize an image to (LLaVA-NeXT)
    merge: int = 0  # Qwen2-VL: the side of the square of patches one token is
    pixels: tuple[int, int] = (0, 0)  # Qwen2-VL: the fewest and most pixels an image is resized to
    frame: tuple[int, int] = (-1, -1)  # Gemma 3: the tokens that open and close an image (its template writes the first)

    def tokens(self, width: int, height: int) -> int:
        """How many tokens an image of `width` × `height` pixels is (ValueError: one the model's
        processor refuses)."""
        if self.merge:
            rows, cols = self.grid(width, height)
            return rows * cols
        if not self.pinpoints:
            return self.base_tokens
        best_h, best_w = best_resolution(height, width, self.pinpoints)
        rows, cols = self.crop[0] // self.patch, self.crop[1] // self.patch
        grid_h, grid_w = rows * (best_h // self.crop[0]), cols * (best_w // self.crop[1])
        # The tiles' patches, less the rows (or columns) of padding the resize left, as the model's
        # `unpad_image` takes them off; a newline token ends each row.
        if width / height > grid_w / grid_h:
            grid_h -= (grid_h - int(round(height * (grid_w / width), 7))) // 2 * 2
        else:
            grid_w -= (grid_w - int(round(width * (grid_h / height), 7))) // 2 * 2
        return self.base_tokens + grid_h * grid_w + grid_h

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Qwen2-VL: the rows and columns of tokens an image of `width` × `height` pixels is."""
        resized_h, resized_w = dynamic_resolution(height, width, self.patch * self.merge, *self.pixels)
        return resized_h // (self.patch * self.merge), resized_w // (self.patch * self.merge)

    def expand(self, ids: list[int], sizes: list[tuple[int, int]]) -> list[int]:
        """`ids` with the image token of each image repeated as many times as the image's (width,
        height) in `sizes` makes it; ValueError unless the prompt holds one image token per image
        (the chat template writes one per image part)."""
        found = ids.count(self.image_token_id)
        if found != len(sizes):
            raise ValueError(f"the prompt has {found} image tokens for {len(sizes)} images: the chat template must "
                             "write one per image part (and a text part may not spell the image token)")
        counts = iter([self.tokens(w, h) for w, h in sizes])
        out: list[int] = []
        for token in ids:
            out.extend([token] * next(counts) if token == self.image_token_id else [token])
        return out


def dynamic_resolution(height: int, width: int, factor: int, fewest: int, most: int) -> tuple[int, int]:
    """Qwen2-VL's resize: the (height, width), multiples of `factor`, nearest the image's with its
    area within [fewest, most] pixels and its aspect kept as far as it can be."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}×{height} pixels is longer than 200 times its width: the model's "
                         "processor takes none such")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > most:
        beta = math.sqrt(height * width / most)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < fewest:
        beta = math.sqrt(fewest / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` an image is resized to: the one that keeps most of its
    pixels (scaled down to fit, never up), then the one that wastes fewest."""
    best, kept_most, wasted_least = pinpoints[0], -1, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > kept_most or (kept == kept_most and wasted < wasted_least):
            best, kept_most, wasted_least = (h, w), kept, wasted
    return best


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
    if family == "gemma3":
        tokens = int(config.get("mm_tokens_per_image") or 256)
        if processor.get("image_seq_length", tokens) != tokens or image.get("do_pan_and_scan"):
            raise UnsupportedVision(f"{folder}: Gemma 3 is served with {tokens} tokens an image and no pan and scan "
                                    "crops (the processor's image_seq_length and do_pan_and_scan)")
        return VisionModel(family, int(config.get("image_token_index", 262_144)), tokens,
                           frame=(int(config.get("boi_token_index", 255_999)), int(config.get("eoi_token_index", 256_000))))
    if family in ("qwen2_vl", "qwen2_5_vl"):
        size = image.get("size") or {}
        fewest = image.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        most = image.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        patch, merge = int(image.get("patch_size") or 0), int(image.get("merge_size") or 0)
        if not (fewest and most and patch and merge):
            raise UnsupportedVision(f"{folder}: the processor's pixel bounds, patch size and merge size are needed "
                                    "to count image tokens")
        return VisionModel(family, int(config["image_token_id"]), 0, patch=patch, merge=merge,
                           pixels=(int(fewest), int(most)))
    crop = image.get("crop_size") or {}
    patch = int(processor.get("patch_size") or config["vision_config"].get("patch_size") or 0)
    if not crop or not patch:
        raise UnsupportedVision(f"{folder}: the processor's crop size and patch size are needed to count image tokens")
    strategy = processor.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")
    height, width = int(crop["height"]), int(crop["width"])
    base = (height // patch) * (width // patch) \
        + int(processor.get("num_additional_image_tokens", 0)) - (1 if strategy == "default" else 0)
    if family == "llava_next":
        pinpoints = tuple((int(h), int(w)) for h, w in image.get("image_grid_pinpoints")
                          or config.get("image_grid_pinpoints") or ())
        if not pinpoints or any(h % height or w % width for h, w in pinpoints):
            raise UnsupportedVision(f"{folder}: LLaVA-NeXT's grid pinpoints must be multiples of the crop size "
                                    f"{height}×{width} (they are {list(pinpoints)})")
        return VisionModel(family, int(config["image_token_index"]), base, (height, width), patch, pinpoints)
    if config.get("image_seq_length") not in (None, base):
        raise UnsupportedVision(f"{folder}: the processor gives {base} tokens an image, the config "
                                f"{config['image_seq_length']}")
    return VisionModel(family, int(config["image_token_index"]), base)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
