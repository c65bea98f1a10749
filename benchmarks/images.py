"""Images through the whole stack against transformers' batched `generate`, in ONE run.

    .venv/bin/python benchmarks/images.py [--requests 32] [--tokens 32] [--rounds 2] [--turns 4]

The model: a LLaVA-1.5 of real shapes with random weights (no hub here), written once to a
temporary folder: a CLIP ViT-B/16 tower at 224 pixels (196 tokens an image, the CLS token dropped),
LLaVA's two-layer projector, and a language model of Qwen2.5-0.5B's shape (24 layers, 896 wide,
14 heads, 2 KV heads; a 400-token byte-level vocabulary, so the head is small). Both sides run it
in the dtype `auto` picks here (bf16 on a CPU with AVX512-BF16, else fp32).

- images/s: `--requests` chat requests with one image each (a different picture each, and new
  ones every round, so no embedding or block is cached), sent at once to one stack (its own
  Redis, one worker with batch size `--requests`, the api), `--tokens` tokens each
  (ignore_eos), against transformers' `generate` on the processor's inputs of the same 32
  prompts and pictures in one batch (left padded), the same tokens; interleaved in `--rounds`.
- second turn: `--turns` chats of one new picture each: the first turn's TTFT (streamed), then a
  second turn holding the first (its picture, the reply, one more question): its TTFT and
  cached_tokens (the first turn's blocks, picture included, and no vision tower run).

Prints a table and the machine (lscpu model and flags).
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, print_machine, print_table
from streamq.stack import Stack
from streamq.testing.tiny_vision import build_llava, data_url, png

VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "projection_dim": 512}
TEXT = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "initializer_range": 0.02, "rms_norm_eps": 1e-6}
QUESTION = "What is in this picture? Describe it."


def build(folder: Path) -> Path:
    return build_llava(folder, image_size=224, patch=16, vision=VISION, text=TEXT, context=2048)


def content(picture: bytes, text: str = QUESTION) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(picture)}}, {"type": "text", "text": text}]


def through_stack(url: str, pictures: list[bytes], tokens: int) -> float:
    """All at once; the seconds until the last reply."""
    def one(picture: bytes) -> int:
        body = {"model": "llava", "messages": [{"role": "user", "content": content(picture)}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(pictures)) as pool:
        done = list(pool.map(one, pictures))
    assert done == [tokens] * len(pictures), done
    return time.perf_counter() - start


class Reference:
    """transformers' LlavaForConditionalGeneration and its processor, in this process."""

    def __init__(self, folder: Path, dtype):
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(folder)
        self.processor.tokenizer.padding_side = "left"
        self.model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()

    def run(self, pictures: list[bytes], tokens: int) -> float:
        import torch
        from PIL import Image

        start = time.perf_counter()
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompt = self.processor.apply_chat_template(chat, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
        inputs = self.processor(images=images, text=[prompt] * len(pictures), add_special_tokens=False,
                                padding=True, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        assert out.shape[1] - inputs["input_ids"].shape[1] == tokens
        return time.perf_counter() - start


def streamed(url: str, messages: list[dict], tokens: int) -> tuple[float, str, int]:
    """TTFT (s), the reply, and its cached prompt tokens."""
    body = {"model": "llava", "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, text, cached = time.perf_counter(), None, [], 0
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):  # the first chunk carries the role and no text
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    return first - start, "".join(text), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    import torch

    from worker.model.model_loader import pick_dtype

    dtype = pick_dtype("auto", torch.device("cpu"))
    folder = Path(tempfile.mkdtemp(prefix="streamq-images-"))
    model = build(folder / "llava")
    settings = {"STREAMQ_MODEL": str(model), "STREAMQ_SERVED_MODEL_NAME": "llava",
                "STREAMQ_BATCH_SIZE": str(args.requests), "STREAMQ_KV_CACHE_GB": "2"}
    stack_s, hf_s, seed = [], [], 1000
    reference = Reference(model, dtype)
    with Stack(folder / "stack", settings, name="images", options=["--log-level", "warning"],
               ready_timeout_s=600) as stack:
        url = stack.url
        through_stack(url, [png(1), png(2)], 4)  # warm
        reference.run([png(1), png(2)], 4)
        for _ in range(args.rounds):
            pictures = [png(seed + i, (320, 240)) for i in range(args.requests)]
            seed += args.requests
            stack_s.append(through_stack(url, pictures, args.tokens))
            hf_s.append(reference.run(pictures, args.tokens))
        turns = []
        for i in range(args.turns):
            picture = png(seed + i, (320, 240))
            first = [{"role": "user", "content": content(picture)}]
            ttft1, reply, cached1 = streamed(url, first, args.tokens)
            second = first + [{"role": "assistant", "content": reply},
                              {"role": "user", "content": "And what colours does it have?"}]
            ttft2, _, cached2 = streamed(url, second, 8)
            turns.append((ttft1, ttft2, cached1, cached2))
    n = args.requests
    best_stack, best_hf = min(stack_s), min(hf_s)
    rows = [[f"{n} requests, one image each, {args.tokens} tokens: images/s", f"{n / best_stack:.2f}",
             f"{n / best_hf:.2f}", f"{best_hf / best_stack:.2f}",
             f"each round (s): {', '.join(f'{a:.1f} / {b:.1f}' for a, b in zip(stack_s, hf_s))}"]]
    ratio = statistics.median(t2 / t1 for t1, t2, _, _ in turns)
    rows.append(["second turn, same image: TTFT ms (first / second)",
                 f"{statistics.median(t[0] for t in turns) * 1000:.0f} / {statistics.median(t[1] for t in turns) * 1000:.0f}",
                 "-", f"{ratio:.2f} (second / first)",
                 f"cached tokens first / second: {', '.join(f'{c1} / {c2}' for _, _, c1, c2 in turns)}"])
    print_table(["measure", "streamq", "transformers", "ratio", "detail"], rows)
    print_machine(machine(str(dtype).removeprefix("torch."), torch.get_num_threads(), requests=n,
                          tokens=args.tokens, rounds=args.rounds))


if __name__ == "__main__":
    main()
