"""Where the model runs, in what dtype, and loading its weights (transformers' own modules)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware computes it fast, fp32 elsewhere."""
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def load_model(folder: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()
