"""Where the model runs, in what dtype, and loading its weights (transformers' own modules).

A GGUF file of a llama-family model is read with its quantized tensors kept quantized
(worker/model/gguf_weights.py, worker/model/quant_model.py) where the paged engine runs it on a CPU; any
other model loads transformers' float weights (a GGUF's dequantised once into the model cache),
and STREAMQ_QUANTIZATION may then compress their projections.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.atomic_folder import atomic_folder
from shared.gguf_convert import gguf_cache
from shared.model_paths import gguf_file, prepare_model, weights_dir
from shared.settings import WorkerSettings
from worker.model import quant_model
from worker.model.kernels import cpu_has

log = logging.getLogger(__name__)

# The model types whose layers the paged runner fuses, and so runs quantized.
QUANTIZABLE = quant_model.LLAMA_FAMILY | {"gemma3_text"}


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _cpu_has_fast_bf16() -> bool:
    return cpu_has("amx_bf16") or cpu_has("avx512_bf16")


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware computes it fast, fp32 elsewhere."""
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def load_model(folder: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if "vision_config" in config:  # a vision-language model (shared/vision_model.py): the static engine runs it
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def load_weights(settings: WorkerSettings, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The settings' model on `device` in `dtype`, its weights quantized as the settings say."""
    step = settings.step
    model = None
    gguf = gguf_file(settings)
    if gguf is not None and settings.mmproj is not None:  # the pair: one transformers model, dequantized
        log.info("%s with the mmproj %s: their weights are dequantized into one vision-language model",
                 gguf.name, settings.mmproj.name)
    elif gguf is not None and step.gguf_weights == "quantized" and device.type == "cpu":
        config = gguf_config(settings, gguf)
        if config.model_type in QUANTIZABLE:
            from worker.model.gguf_weights import build_model, load_gguf

            model = build_model(config, load_gguf(gguf, config)[1], dtype)
            log.info("loaded %s with its quantized tensors kept quantized", gguf.name)
        else:
            log.info("%s (%s): no quantized path for this architecture; its weights are dequantized",
                     gguf.name, config.model_type)
    if model is None:
        prepare_model(settings)
        model = load_model(weights_dir(settings), device, dtype)
    if step.quantization != "none":
        if model.config.model_type not in QUANTIZABLE or device.type != "cpu":
            raise ValueError(f"quantization={step.quantization} needs a llama-family or Gemma 3 model on a CPU "
                             f"(this is {model.config.model_type!r} on {device.type})")
        quant_model.compress(model, step.quantization)
    log.info("weights: %.0f MiB (quantized ones counted packed)", quant_model.weight_bytes(model) / 2**20)
    return model


def gguf_config(settings: WorkerSettings, gguf: Path):
    """The GGUF's transformers config, parsed from the file once (slow: every metadata entry) and
    kept beside its other converted files in the model cache."""
    converted = gguf_cache(settings, gguf)  # stats the file: once
    folder = converted.with_name(converted.name + "-config")
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    from worker.model.gguf_weights import gguf_config as parse

    config = parse(gguf)
    with atomic_folder(folder, whole=lambda f: (f / "config.json").is_file()) as partial:
        config.save_pretrained(partial)
    return config
