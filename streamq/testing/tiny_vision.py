"""Tiny vision-language models with random weights, written by the tests from configs: LLaVA-1.5
(a CLIP vision tower, a projector and a llama), LLaVA-NeXT (the same, with anyres tiles and an
image newline) and Qwen2-VL (its own tower at dynamic resolution, a Qwen2 with M-RoPE), saved with
their processors as their hub repos are, over the tiny byte-level tokenizer
(streamq/testing/tiny_models.py) with the image tokens added."""
from __future__ import annotations

import io
from pathlib import Path

from streamq.testing.tiny_models import build_tokenizer

IMAGE_SIZE, PATCH = 28, 14  # 2 × 2 patches: 4 tokens an image (the CLS token dropped, as LLaVA-1.5 does)
# LLaVA-NeXT's grid, in crops of IMAGE_SIZE: a wide, a tall, a square and two long shapes
PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
# A chat template that writes an image part as <image>, as LLaVA's do
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
            "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_llava(folder: Path, seed: int = 0, image_size: int = IMAGE_SIZE, patch: int = PATCH,
                vision: dict | None = None, text: dict | None = None, context: int = 512,
                family: str = "llava") -> Path:
    """A tiny LLaVA-1.5 in `folder` (`family` llava_next: a LLaVA-NeXT): weights, config, processor,
    tokenizer and chat template. `vision`, `text`: other sizes for the CLIP tower's and the llama's
    configs (a benchmark's model of a real one's shape; its weights still random)."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor, LlavaProcessor, PreTrainedTokenizerFast)

    vocab = build_tokenizer(folder, context=context, chat_template=TEMPLATE, special_tokens=("<image>",))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    tower = CLIPVisionConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "projection_dim": 32, **(vision or {}),
                                "image_size": image_size, "patch_size": patch})
    language = LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2,
                              **(text or {}), "vocab_size": vocab, "max_position_embeddings": context,
                              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    common = dict(vision_config=tower, text_config=language, image_token_index=image_token,
                  vision_feature_layer=-1, vision_feature_select_strategy="default")
    sizes = dict(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    if family == "llava_next":
        pinpoints = [[h * image_size // IMAGE_SIZE, w * image_size // IMAGE_SIZE] for h, w in PINPOINTS]
        config, model_class = LlavaNextConfig(**common, image_grid_pinpoints=pinpoints), LlavaNextForConditionalGeneration
        processor_class = LlavaNextProcessor
        image_processor = LlavaNextImageProcessor(**sizes, image_grid_pinpoints=pinpoints)
    else:
        config, model_class = LlavaConfig(**common, image_seq_length=(image_size // patch) ** 2), LlavaForConditionalGeneration
        processor_class, image_processor = LlavaProcessor, CLIPImageProcessor(**sizes)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # away from init, so that the image changes the reply
        for name, p in model.named_parameters():
            if "vision" in name or "projector" in name or "image_newline" in name:
                p.normal_(0, 0.3 if vision is None else 0.02)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                chat_template=TEMPLATE)
    processor.save_pretrained(folder)
    return folder


QWEN_TEMPLATE = TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_PIXELS = (28 * 28 * 2, 28 * 28 * 12)  # the fewest and most pixels an image is resized to: 2 to 12 tokens


def build_qwen2_vl(folder: Path, seed: int = 0, family: str = "qwen2_vl", context: int = 512) -> Path:
    """A tiny Qwen2-VL (`family` qwen2_5_vl: a Qwen2.5-VL) in `folder`: weights, config, image
    processor, tokenizer and chat template (no processor class: transformers builds Qwen's only
    with torchvision, for its video processor; the image processor and the tokenizer are what it
    runs on images). Patches of 14 pixels, 2 × 2 of them a token, M-RoPE sections (time, height,
    width) of a 16-wide head."""
    import torch
    from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vocab = build_tokenizer(folder, context=context, chat_template=QWEN_TEMPLATE,
                            special_tokens=("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": context,
            "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}
    vision = {"depth": 2, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2_5_vl":
        vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 56,
                   "fullatt_block_indexes": [1]}
        config_class = Qwen2_5_VLConfig
    else:
        vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        config_class = Qwen2VLConfig
    config = config_class(text_config=text, vision_config=vision, image_token_id=pad, vision_start_token_id=start,
                          vision_end_token_id=end, video_token_id=vocab + 1)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # away from init, so that the image changes the reply
        for name, p in model.named_parameters():
            if "visual" in name:
                p.normal_(0, 0.3)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=QWEN_PIXELS[0], max_pixels=QWEN_PIXELS[1], patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(folder)
    return folder


GEMMA_TEMPLATE = TEMPLATE.replace("<image>\n", "<start_of_image>")
GEMMA_IMAGE = 56  # a SigLIP of 4 × 4 patches of 14, pooled 2 × 2: 4 soft tokens an image


def build_gemma3(folder: Path, seed: int = 0, context: int = 512, gguf_shaped: bool = False) -> Path:
    """A tiny Gemma 3 with vision (Gemma3ForConditionalGeneration: a SigLIP tower, its patches
    average-pooled to `mm_tokens_per_image` soft tokens, a Gemma 3 text model) in `folder`, with its
    processor: the chat template writes <start_of_image>, which the processor writes out as
    "\n\n<start_of_image>", the soft tokens, "<end_of_image>\n\n". `gguf_shaped`: a text model
    whose every setting a GGUF file carries or transformers' default for it gives (6 layers, the
    sixth global; a tied head, its embeddings scaled down so the reply is no copy of the prompt's
    last token), for write_gemma3_gguf and write_mmproj."""
    import json

    import torch
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor,
                              PreTrainedTokenizerFast)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    vocab = build_tokenizer(folder, context=context, chat_template=GEMMA_TEMPLATE,
                            special_tokens=("<start_of_image>", "<end_of_image>", "<image_soft_token>"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"}
    config_path.write_text(json.dumps(config))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    boi, eoi, soft = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab, "max_position_embeddings": context,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"], "initializer_range": 0.2,
            "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    if gguf_shaped:
        del text["layer_types"]
        text |= {"num_hidden_layers": 6, "tie_word_embeddings": True}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": GEMMA_IMAGE, "patch_size": 14, "vision_use_head": False}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
                          eoi_token_index=eoi, image_token_index=soft, initializer_range=0.2,
                          tie_word_embeddings=gguf_shaped)  # a tied head repeats the last token: the image would change nothing
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # away from init, so that the image changes the reply
        for name, p in model.named_parameters():
            if "vision" in name or "multi_modal" in name:
                p.normal_(0, 0.3)
            if gguf_shaped and "embed_tokens" in name:
                p.mul_(0.1)
            if gguf_shaped and "input_projection" in name:  # llama.cpp's mmproj keeps it in F16: lossless so
                p.copy_(p.half().float())
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE})
    Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA_TEMPLATE,
                    image_seq_length=4).save_pretrained(folder)
    return folder


FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")


def build(family: str, folder: Path) -> Path:
    """A tiny model of `family` (one of FAMILIES) in `folder`."""
    if family.startswith("qwen"):
        return build_qwen2_vl(folder, family=family)
    if family == "gemma3":
        return build_gemma3(folder)
    return build_llava(folder, family=family)


def png(seed: int, size: tuple[int, int] = (40, 50), kind: str = "PNG") -> bytes:
    """A random picture of `size` (width, height), encoded as `kind`."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def reference_tokens(folder: Path, parts: list, max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy reply to one user message of `parts` (bytes: a picture, str: text) on
    the processor's inputs (its chat template, its image processing): the new token ids."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)] or None
    inputs = processor_inputs(folder, [{"role": "user", "content": content}], images)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens if ignore_eos else None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def processor_inputs(folder: Path, messages: list[dict], images: list | None) -> dict:
    """The model's processor's inputs for `messages` and their PIL `images`. Qwen2-VL's as its
    processor makes them (its image processor's pixels and grid; its chat template's text, each
    image pad repeated a token per merged square of patches; its token types), the others by
    their processor."""
    import json

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if json.loads((folder / "config.json").read_text())["model_type"] not in ("qwen2_vl", "qwen2_5_vl"):
        processor = AutoProcessor.from_pretrained(folder)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        return processor(images=images, text=prompt, add_special_tokens=False, return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = {}
    if images:
        image_processor = AutoImageProcessor.from_pretrained(folder)
        out = dict(image_processor(images, return_tensors="pt"))
        counts = iter((out["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist())
        prompt = "".join(piece + ("<|image_pad|>" * next(counts) if i < prompt.count("<|image_pad|>") else "")
                         for i, piece in enumerate(prompt.split("<|image_pad|>")))
    text = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {**text, **out, "mm_token_type_ids": (text["input_ids"] == image_token).int()}


def write_gemma3_ggufs(model: Path, text_path: Path, mmproj_path: Path) -> tuple[Path, Path]:
    """The pair of files llama.cpp serves a Gemma 3 with images from, for a `gguf_shaped`
    build_gemma3 folder: its language model as a text GGUF (architecture gemma3, its BPE vocabulary
    and chat template, every norm stored plus one as llama.cpp's converter stores Gemma's) and its
    vision tower and projector as an mmproj GGUF laid out as llama.cpp's `convert_hf_to_gguf.py
    --mmproj` writes one (architecture clip, projector type gemma3, tensor names from gguf-py's
    table, the projector's norm plus one, its input projection in F16). All F32 otherwise."""
    import json

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from streamq.testing.tiny_models import finish

    config = json.loads((model / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    special = {t["content"] for t in tokenizer["added_tokens"]}
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    weights = {name: tensor.to(torch.float32).numpy() for name, tensor in load_file(model / "model.safetensors").items()}

    writer = gguf.GGUFWriter(str(text_path), "gemma3")
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_freq_base(text["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(text["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(GEMMA_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text["num_hidden_layers"])
    for name, data in weights.items():  # transformers saves the language model as language_model.model.*
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                hf = "model." + name[len(prefix):]
                writer.add_tensor(names.get_name(hf, try_suffixes=(".weight",)),
                                  data + 1 if name.endswith("norm.weight") else data)
    finish(writer)

    writer = gguf.GGUFWriter(str(mmproj_path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", text["hidden_size"])
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    writer.add_bool("clip.use_gelu", True)
    per_side = int(config["mm_tokens_per_image"] ** 0.5)
    if (scale := vision["image_size"] // vision["patch_size"] // per_side) != 4:
        writer.add_uint32("clip.vision.projector.scale_factor", scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, data in weights.items():
        if name.startswith(("vision_tower.", "model.vision_tower.")):
            hub = "vision_tower.vision_model." + name.split("vision_tower.", 1)[1]
        elif name.startswith(("multi_modal_projector.", "model.multi_modal_projector.")):
            hub = "multi_modal_projector." + name.split("multi_modal_projector.", 1)[1].replace("_weight", ".weight")
        else:
            continue
        if "soft_emb_norm" in hub:
            data = data + 1
        if "input_projection" in hub:
            data = data.astype(np.float16)
        writer.add_tensor(names.get_name(hub, try_suffixes=(".weight", ".bias")), data)
    finish(writer)
    return text_path, mmproj_path
