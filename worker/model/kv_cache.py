"""The paged KV cache: its shape from the model, each layer's sliding window, how many blocks a
memory budget holds, the two tensors allocated once at start (never grown), and one block read
and written as bytes (the shared KV tier's unit, worker/engine/kv_tier.py)."""
from __future__ import annotations

import torch


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model's attention."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def layer_windows(config) -> list[int]:
    """Each layer's sliding window (0: it attends to the whole context), as transformers applies it:
    a query at position p sees keys p-window+1 .. p. The layers `layer_types` names sliding (Qwen2,
    Qwen3, Gemma 3), or every layer where the config has a window and no layer types (Mistral, Phi-3)."""
    layers = config.num_hidden_layers
    window = int(getattr(config, "sliding_window", None) or 0)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return [window if kind == "sliding_attention" else 0 for kind in kinds[:layers]]
    if getattr(config, "use_sliding_window", True) is False:
        return [0] * layers
    return [window] * layers


def blocks_for_bytes(model: torch.nn.Module, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    layers, kv_heads, head_dim = kv_shape(model)
    per_block = 2 * layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max(1, budget_bytes // per_block)


def allocate(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, blocks: int,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' and the values' cache, zeroed: [layers, kv heads, blocks, block_size, head dim].
    Head-major: one head's keys of a block are contiguous, so a gather of a sequence's blocks gives
    each (sequence, head) its [context, head_dim] matrix in one piece for the matmuls."""
    layers, kv_heads, head_dim = kv_shape(model)
    shape = (layers, kv_heads, blocks, block_size, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def block_bytes(k_cache: torch.Tensor) -> int:
    """Bytes of one cache block's keys and values, all layers (what read_block gives)."""
    layers, heads, _, size, dim = k_cache.shape
    return 2 * layers * heads * size * dim * k_cache.element_size()


def read_block(k_cache: torch.Tensor, v_cache: torch.Tensor, block_id: int) -> bytes:
    """One cache block's keys then values, every layer, as the cache holds them."""
    kv = torch.stack((k_cache[:, :, block_id], v_cache[:, :, block_id])).cpu()
    return kv.view(torch.uint8).numpy().tobytes()


def write_block(k_cache: torch.Tensor, v_cache: torch.Tensor, block_id: int, data: bytes | memoryview) -> None:
    """Put `data` (read_block's form) in cache block `block_id`."""
    layers, heads, _, size, dim = k_cache.shape
    kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(k_cache.dtype)
    kv = kv.view(2, layers, heads, size, dim).to(k_cache.device)
    k_cache[:, :, block_id] = kv[0]
    v_cache[:, :, block_id] = kv[1]
