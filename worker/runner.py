"""The model runner: the only torch code of the engine.

It runs one batch of prompts with a KV cache: one prefill of all prompts (left-padded, each
at its own positions), then one forward per decode step that feeds only the newest token of
each row and reuses the cache, so no step recomputes a prompt.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

log = logging.getLogger(__name__)


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


class BatchRunner:
    """Forward passes over one batch of rows that share a KV cache."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int = 0):
        self.model = model
        self.device = device
        self.pad_id = pad_id
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._next_pos: torch.Tensor | None = None

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Start a new batch; return the logits of each prompt's last position, [rows, vocab]."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._cache = DynamicCache(config=self.model.config)
        self._mask = mask
        self._next_pos = positions[:, -1] + 1
        return self._forward(ids, positions)

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one new token per row; return next-token logits, [rows, vocab]."""
        assert self._cache is not None and self._mask is not None and self._next_pos is not None
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        positions = self._next_pos.unsqueeze(1)
        self._next_pos = self._next_pos + 1
        return self._forward(ids, positions)

    def release(self) -> None:
        """Free the batch's KV cache."""
        self._cache = self._mask = self._next_pos = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: self._cache})
        return out.logits[:, -1, :]
