"""A vision-language model's images in the paged engine (worker/engine/core.py): the vision tower
and projector run inside the engine's step, batched over the images of the step's chunks, and
their embeddings take the place of the image tokens' rows in the forward.

LLaVA-1.5 and LLaVA-NeXT (transformers' LlavaForConditionalGeneration and
LlavaNextForConditionalGeneration): the paged runner runs the language model (`TextView`), and
`ImageEncoder` gives each image its embeddings (as many as shared/vision_model.py counts for its
size), as the model's own `get_image_features` computes them from the processor's pixels.
Embeddings are kept by image (its sha256, under the request's prefix-cache root: a tenant's image
never answers another tenant's from this cache, so no timing tells one tenant what another sent),
least recently used out first. A request's image tokens hash into the prefix cache as keys of
that image (`Images.cache_ids`): the same text with another picture shares no block from the
image on, and a second turn with the same picture reuses the blocks of the first.
"""
from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from shared.vision_model import VisionModel

EMBEDDINGS_KEPT = 64  # images whose embeddings a worker keeps (576 rows each for LLaVA-1.5: 4.7 MB at 4096 wide, bf16)


@dataclass
class Images:
    """A request's images: their keys (sha256), where their tokens sit in the prompt, their bytes,
    and the prompt as the prefix cache hashes it (`cache_ids`)."""

    keys: list[str]
    spans: list[tuple[int, int]]  # (first position, tokens) of each image, in prompt order
    data: list[bytes] = field(repr=False)
    keyed_prompt: list[int] = field(repr=False, default_factory=list)
    rope: list[list[int]] | None = field(repr=False, default=None)  # M-RoPE's three axes over the prompt (Qwen2-VL)
    rope_delta: int = 0  # M-RoPE: a token after the prompt is at its index plus this, on every axis

    @classmethod
    def of(cls, prompt_ids: Seq[int], vision: VisionModel, keys: list[str], data: list[bytes]) -> Images:
        """Find each image's run of image tokens (the api expanded one per image, as many as the
        image's size makes it); ValueError where the prompt's runs do not match the images."""
        sizes = [size_of(d) for d in data]
        counts = [vision.tokens(*size) for size in sizes]
        spans, i, n, k = [], 0, len(prompt_ids), 0
        while i < n:
            if prompt_ids[i] == vision.image_token_id:
                start = i
                while i < n and prompt_ids[i] == vision.image_token_id and (k >= len(counts) or i - start < counts[k]):
                    i += 1
                spans.append((start, i - start))
                k += 1
            else:
                i += 1
        if [length for _, length in spans] != counts:
            raise ValueError(f"the prompt's image tokens ({[length for _, length in spans]}) are not "
                             f"{len(data)} images of {counts} tokens")
        if len(keys) != len(data):
            keys = [hashlib.sha256(d).hexdigest() for d in data]
        # Each image token as a key of its image and place in it (a negative number, never a token
        # id): computed once, for the prefix cache's block hashes.
        keyed = list(prompt_ids)
        for key, (start, length) in zip(keys, spans):
            base = int(key[:12], 16) << 12  # 48 bits of the image's hash, then the token's place
            for offset in range(length):
                keyed[start + offset] = -1 - (base | (offset & 0xFFF))
        images = cls(list(keys), spans, list(data), keyed)
        if vision.merge:
            images.rope, images.rope_delta = _rope(len(prompt_ids), spans, [vision.grid(*size) for size in sizes])
        return images

    def rope_positions(self, start: int, end: int) -> list[list[int]] | None:
        """M-RoPE's (time, height, width) positions of tokens start .. end; None: not an M-RoPE model."""
        if self.rope is None:
            return None
        n = len(self.rope[0])
        after = list(range(max(start, n) + self.rope_delta, end + self.rope_delta))
        return [axis[start:end] + after for axis in self.rope]

    def cache_ids(self, token_ids: Seq[int]) -> list[int]:
        """`token_ids` (the prompt, then the output) with each image token keyed by its image."""
        return self.keyed_prompt + list(token_ids[len(self.keyed_prompt):])

    def attention_ends(self, start: int, end: int) -> list[int] | None:
        """The last key each token start .. end attends to where an image's tokens attend to each
        other both ways (asked only of a model whose do: TextView.images_both_ways): an image's
        last for its tokens, else its own; None where every one is its own."""
        if not any(s < end and start < s + n for s, n in self.spans):
            return None
        ends = list(range(start, end))
        for s, n in self.spans:
            for p in range(max(s, start), min(s + n, end)):
                ends[p - start] = s + n - 1
        return ends

    def image_at(self, position: int) -> tuple[int, int] | None:
        """(start, end) of the image holding `position`, if one does."""
        for start, length in self.spans:
            if start <= position < start + length:
                return start, start + length
        return None


def _rope(n: int, spans: list[tuple[int, int]], grids: list[tuple[int, int]]) -> tuple[list[list[int]], int]:
    """M-RoPE's positions of a prompt of `n` tokens with images at `spans` of `grids` (rows, columns
    of tokens), as Qwen2-VL's get_rope_index gives them: a text token one past the last position on
    every axis; an image's tokens row by row, all at the next position in time, at it plus their
    row in height and plus their column in width; the text after an image from that position plus
    the image's longer side. Returns the three axes and the offset of the tokens after the prompt."""
    axes: list[list[int]] = [[], [], []]
    at, i = 0, 0
    for (start, length), (rows, cols) in zip(spans, grids):
        for axis in axes:
            axis += range(at, at + start - i)
        at += start - i
        axes[0] += [at] * length
        axes[1] += [at + r for r in range(rows) for _ in range(cols)]
        axes[2] += [at + c for _ in range(rows) for c in range(cols)]
        at, i = at + max(rows, cols), start + length
    for axis in axes:
        axis += range(at, at + n - i)
    return axes, at + n - i - n


class TextView(torch.nn.Module):
    """The language model of a LLaVA model as the paged runner reads a text model: `.model` (its
    embeddings, layers, norm and rotary), `.lm_head`, `.config` (the text config). The same
    modules, not copies."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model.model.language_model
        self.lm_head = model.lm_head
        self.config = model.config.text_config
        self.images_both_ways = model.config.model_type == "gemma3"  # its image tokens attend to each other

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


class ImageEncoder:
    """The vision tower and projector of a LLaVA model, with the processor that makes its pixels."""

    def __init__(self, model: torch.nn.Module, processor, vision: VisionModel, kept: int = EMBEDDINGS_KEPT):
        self.model = model
        self.processor = processor
        self.vision = vision
        self.kept = kept
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._cache: OrderedDict[tuple[int | None, str], torch.Tensor] = OrderedDict()
        self.images_encoded = 0  # images run through the tower (the rest came from the cache)

    def embeddings(self, wanted: list[tuple[int | None, str, bytes]]) -> list[torch.Tensor]:
        """Each (prefix root, key, bytes)'s embeddings [its tokens, hidden]: from the cache,
        or from one batched run of the tower over those it lacks."""
        missing = list(dict.fromkeys((root, key) for root, key, _ in wanted if (root, key) not in self._cache))
        if missing:
            data = {(root, key): blob for root, key, blob in wanted}
            features = self._encode([data[m] for m in missing])
            self.images_encoded += len(missing)
            for k, f in zip(missing, features):
                self._cache[k] = f
        out = []
        for root, key, _ in wanted:
            self._cache.move_to_end((root, key))
            out.append(self._cache[(root, key)])
        while len(self._cache) > max(self.kept, len(wanted)):
            self._cache.popitem(last=False)
        return out

    @torch.inference_mode()
    def _encode(self, blobs: list[bytes]) -> list[torch.Tensor]:
        inputs = processor_inputs(self.processor, blobs, self.device, self.dtype)
        config = self.model.config  # LLaVA's choice of layer and of tokens (Qwen2-VL has none)
        chosen = {k: getattr(config, k) for k in ("vision_feature_layer", "vision_feature_select_strategy")
                  if hasattr(config, k)}
        features = self.model.model.get_image_features(**inputs, **chosen)
        if hasattr(features, "pooler_output"):  # transformers' output object
            features = features.pooler_output
        if isinstance(features, torch.Tensor):  # LLaVA-1.5: [images × tokens, hidden] or [images, tokens, hidden]
            features = list(features.reshape(len(blobs), -1, features.shape[-1]))
        features = list(features)  # LLaVA-NeXT: an image each, of its own length
        for data, feature in zip(blobs, features):
            want = self.vision.tokens(*size_of(data))
            if feature.shape[0] != want:
                raise ValueError(f"the vision tower gave {feature.shape[0]} embeddings for an image, the processor "
                                 f"counts {want}")
        return features


def _frames(blobs: list[bytes]) -> list:
    """The images decoded, as RGB. Decoded in the model thread: the api checked every one already;
    a GIF gives its first frame."""
    from PIL import Image

    frames = []
    for data in blobs:
        with Image.open(io.BytesIO(data)) as image:
            image.seek(0)
            frames.append(image.convert("RGB"))
    return frames


def size_of(data: bytes) -> tuple[int, int]:
    """An image's (width, height), read from its header."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except OSError as exc:  # bytes that are no image (the api checked them: not from it)
        raise ValueError(f"an image cannot be read ({exc})") from None


def processor_inputs(processor, blobs: list[bytes], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The images as the model's image processor gives them, on `device`: `pixel_values` in
    `dtype`, and beside them LLaVA-NeXT's `image_sizes`, Qwen2-VL's `image_grid_thw`."""
    out = processor(_frames(blobs), return_tensors="pt")
    inputs = {"pixel_values": out["pixel_values"].to(device, dtype)}
    for key in ("image_sizes", "image_grid_thw"):
        if key in out:
            inputs[key] = out[key].to(device)
    return inputs
