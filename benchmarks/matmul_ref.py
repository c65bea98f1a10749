"""Two yardsticks for the engine benchmark, both in the run's dtype on this machine's threads:

- the matmul reference: the model's own weight matrices multiplied at W's shapes (prefill, then
  one decode step per new token at the full batch), nothing else of the model;
- the GEMM-peak limit: W's arithmetic (2 x weights x rows, lm_head included) divided by the best
  rate of torch's matmul and of oneDNN's prepacked matmul on large square matrices (on an AMD
  EPYC torch's fp32 matmul is MKL's and reached half of oneDNN's rate, so torch's alone would
  put the limit under what the engines do). No engine should beat it; attention's own products
  (a few percent at W's short contexts) are left out, so it is slightly generous.
"""
from __future__ import annotations

import time

import torch

GEMM_SIZE = 2048
GEMM_REPEATS = 5


def _linears(model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    head = model.lm_head.weight
    body = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    return body, head


def run_matmul_ref(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """The matmuls of the real weights alone: W's prefill, then decode steps at the full batch."""
    weights, head = _linears(model)
    hidden = model.config.hidden_size
    dtype = head.dtype
    total_prompt = sum(len(p) for p in prompts)
    batch = len(prompts)
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def rows_of(rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in inputs:
            inputs[(rows, width)] = torch.randn(rows, width, dtype=dtype)
        return inputs[(rows, width)]

    def step(rows: int, head_rows: int) -> None:
        for w in weights:  # every projection of every layer, each with its own weights
            torch.mm(rows_of(rows, w.shape[1]), w.t())
        torch.mm(rows_of(head_rows, hidden), head.t())

    with torch.inference_mode():
        step(batch, batch)  # warm-up
        t0 = time.perf_counter()
        step(total_prompt, batch)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            step(batch, batch)
        decode = time.perf_counter() - t1
    wall = prefill + decode
    return {"mode": "matmul-ref", "requests": batch, "output_tokens": batch * new_tokens, "wall_s": round(wall, 2),
            "tok_per_s": round(batch * new_tokens / wall, 1), "prefill_s": round(prefill, 3),
            "decode_step_ms": round(1000 * decode / new_tokens, 1)}


def gemm_rate(dtype: torch.dtype, size: int = GEMM_SIZE, repeats: int = GEMM_REPEATS) -> float:
    """FLOP/s of the best of `repeats` size x size x size matmuls (after one warm-up), the better
    of torch's matmul and oneDNN's over a prepacked weight."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    products = [lambda: torch.mm(a, b)]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), size)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    with torch.inference_mode():
        for product in products:
            product()
            for _ in range(repeats):
                t0 = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def w_flops(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """W's matmul arithmetic: every prompt token and every fed-back token through the layers'
    weights; one lm_head row per emitted token (prefill emits each request's first token, so
    the decode steps feed new_tokens - 1 tokens per request)."""
    body, head = _linears(model)
    body_params = sum(w.numel() for w in body)
    head_params = head.numel()
    body_rows = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1)
    head_rows = len(prompts) * new_tokens
    return {"body_params": body_params, "head_params": head_params, "body_rows": body_rows, "head_rows": head_rows,
            "flops": 2 * body_params * body_rows + 2 * head_params * head_rows}


def gemm_limit(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """The physical limit on W: its output tokens over (its FLOPs / this machine's GEMM rate)."""
    rate = gemm_rate(model.lm_head.weight.dtype)
    work = w_flops(model, prompts, new_tokens)
    seconds = work["flops"] / rate
    tokens = len(prompts) * new_tokens
    return {"mode": "gemm-peak-limit", "requests": len(prompts), "output_tokens": tokens,
            "wall_s": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1),
            "gemm_gflops_per_s": round(rate / 1e9, 1), "w_gflop": round(work["flops"] / 1e9, 1), **work}
