"""llama.cpp's pair of files for a vision-language model: a text GGUF and its `mmproj` GGUF (the
vision tower and projector, as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes them), served
as the model transformers knows (STREAMQ_MMPROJ beside a GGUF STREAMQ_MODEL).

Served: Gemma 3 (`clip.projector_type` gemma3: a SigLIP tower, its patches average-pooled to soft
tokens, an RMS norm and an input projection; the text GGUF's vocabulary has <start_of_image>,
<end_of_image> and <image_soft_token>). `describe` writes what the api reads of it into the
tokenizer folder (config.json's vision_config and image tokens, the image processor's settings;
no torch: the api runs it); `vision_weights` reads the tower's and projector's tensors for the
worker's conversion (shared/gguf_convert.py), named as transformers' Gemma 3 names them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.tokenizer_files import gguf_metadata

PROJECTORS = ("gemma3",)
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # Gemma 3's boi, eoi, soft token


class UnsupportedMmproj(ValueError):
    """An mmproj file this server does not serve (its projector, or a text model without its tokens)."""


def described(folder: Path) -> bool:
    """`folder` (a tokenizer folder) has an mmproj's description written into it."""
    path = folder / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def describe(mmproj: Path, folder: Path) -> None:
    """Write into the tokenizer folder `folder` what the api and the worker read of the model the
    pair makes: config.json's model_type, vision_config and image tokens; the image processor's
    settings (preprocessor_config.json) and the tokens an image is (processor_config.json)."""
    meta = gguf_metadata(mmproj)
    kind = meta.get("clip.projector_type")
    if meta.get("general.architecture") != "clip" or kind not in PROJECTORS:
        raise UnsupportedMmproj(f"{mmproj}: an mmproj of projector {kind!r} is not served here "
                                f"({', '.join(PROJECTORS)} is)")
    vocab = _vocabulary(folder)
    missing = [t for t in IMAGE_TOKENS if t not in vocab]
    if missing:
        raise UnsupportedMmproj(f"{mmproj}: the text GGUF's vocabulary lacks {missing}, which Gemma 3's images need")
    size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    per_side = size // patch // int(meta.get("clip.vision.projector.scale_factor", 4))
    vision = {"model_type": "siglip_vision_model", "hidden_size": meta["clip.vision.embedding_length"],
              "intermediate_size": meta["clip.vision.feed_forward_length"],
              "num_hidden_layers": meta["clip.vision.block_count"],
              "num_attention_heads": meta["clip.vision.attention.head_count"], "image_size": size,
              "patch_size": patch, "layer_norm_eps": meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6),
              "vision_use_head": False}
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "gemma3", "vision_config": vision, "mm_tokens_per_image": per_side * per_side,
               "boi_token_index": vocab[IMAGE_TOKENS[0]], "eoi_token_index": vocab[IMAGE_TOKENS[1]],
               "image_token_index": vocab[IMAGE_TOKENS[2]], "mmproj_file": mmproj.name}
    image = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": size, "width": size},
             "image_mean": meta.get("clip.vision.image_mean", [0.5] * 3),
             "image_std": meta.get("clip.vision.image_std", [0.5] * 3), "do_resize": True, "resample": 2,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
             "do_pan_and_scan": False}
    _write(folder / "preprocessor_config.json", image)
    _write(folder / "processor_config.json", {"processor_class": "Gemma3Processor",
                                              "image_seq_length": per_side * per_side})
    _write(folder / "config.json", config)  # last: it marks the folder described


def vision_weights(mmproj: Path, blocks: int) -> dict[str, Any]:
    """The tower's and projector's tensors (torch, float32), named as transformers' Gemma 3 names
    them (model.vision_tower..., model.multi_modal_projector...), from llama.cpp's names (gguf-py's
    table, as its converter wrote them) and with its converter's changes undone (the projector's
    norm stored plus one). Worker side: imports torch and gguf."""
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    layers = [f"vision_tower.vision_model.encoder.layers.{i}.{part}" for i in range(blocks) for part in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "layer_norm1",
               "layer_norm2", "mlp.fc1", "mlp.fc2")]
    hub = layers + ["vision_tower.vision_model.embeddings.patch_embedding",
                    "vision_tower.vision_model.embeddings.position_embedding",
                    "vision_tower.vision_model.post_layernorm", "multi_modal_projector.mm_soft_emb_norm",
                    "multi_modal_projector.mm_input_projection"]
    ours = {}
    for name in hub:
        for suffix in (".weight", ".bias"):
            ours[table.get_name(name + suffix, try_suffixes=(".weight", ".bias"))] = name + suffix
    out = {}
    for tensor in gguf.GGUFReader(str(mmproj)).tensors:
        name = ours.get(tensor.name)
        if name is None:
            raise UnsupportedMmproj(f"{mmproj}: tensor {tensor.name!r} is not one of Gemma 3's vision tower")
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if "soft_emb_norm" in name:
            data = data - 1
        if name.startswith("vision_tower.vision_model."):
            name = "model.vision_tower." + name[len("vision_tower.vision_model."):]
        else:  # the projector's parameter is mm_input_projection_weight, not a module's weight
            name = "model." + name.replace("mm_input_projection.weight", "mm_input_projection_weight")
        out[name] = torch.from_numpy(data.copy())
    return out


def _vocabulary(folder: Path) -> dict[str, int]:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"].get("vocab") or {}
    vocab = {piece: i for i, (piece, _) in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)  # Unigram: [piece, score]
    vocab |= {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    return vocab


def _write(path: Path, content: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)
