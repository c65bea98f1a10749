"""A SmolLM2-135M-shaped llama with random weights and the real SmolLM2 tokenizer, for a GPU
machine that has no model weights and no network.

    python benchmarks/gpu/random_model.py FOLDER [--layers 30] [--dtype bfloat16]

The shape is the default model's (576 hidden, 9 heads, 3 kv heads, 1536 MLP, 49,152 vocabulary,
8,192 context), so every step does the same work as with the real weights; the tokenizer is the
real one (smollm2/, tokenizer.json compressed), so workload W has the same 1,336 prompt tokens.
The text it writes is noise: W fixes 64 new tokens per request with ignore_eos, so the
throughput and latency it measures do not depend on what the tokens say.
"""
from __future__ import annotations

import argparse
import lzma
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

TOKENIZER = Path(__file__).resolve().parent / "smollm2"


def smollm2_config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build(folder: Path, layers: int, dtype: torch.dtype, seed: int = 0) -> int:
    """Write the model and tokenizer into `folder`; return the number of parameters."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # random init is faster there
    with device:
        model = AutoModelForCausalLM.from_config(smollm2_config(layers), dtype=dtype)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(lzma.decompress((TOKENIZER / "tokenizer.json.xz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=30, help="30 as SmolLM2-135M; fewer for a quick CPU run")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (the worker casts to its own)")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    params = build(args.folder, args.layers, getattr(torch, args.dtype))
    print(f"random SmolLM2-135M-shaped model ({args.layers} layers, {params / 1e6:.1f} M parameters) "
          f"in {args.folder} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
