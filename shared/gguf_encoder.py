"""Encoder models in llama.cpp's GGUF files, its `bert` and `nomic-bert` architectures as its
convert_hf_to_gguf.py writes them, turned into the folder a sentence-transformers model has: a
transformers config and safetensors weights (dequantised once, fp32), a WordPiece tokenizer.json,
and the modules (Pooling from the file's pooling type, then Normalize). From there the encoder
loads and runs as any other (worker/model/encoders.py).

What the file holds and how it reads back:
- the vocabulary in llama.cpp's "phantom space" form: a word's first piece carries U+2581, a
  continuation none, a control token stays as it is; read back as WordPiece's `##` pieces;
- lower-casing and accent stripping from `tokenizer.ggml.normalizer.*`; files written before
  those keys existed lower-case where the vocabulary has no capital letter (an uncased model);
- [CLS] as the BOS token and [SEP] as the separator: `[CLS] a [SEP]`, a pair `[CLS] a [SEP] b [SEP]`;
- `{arch}.pooling_type`: mean, CLS or last token (none given: mean, as sentence-transformers pools
  a plain transformers folder); rank (a reranker's head) is refused at start;
- embeddings are L2-normalised, as llama.cpp's server returns them by default.

Runs where the tokenizer folder is built (a child process of the api, or the worker): numpy and
the gguf package, no torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.pooling_model import UnsupportedEncoder

ARCHITECTURES = {"bert": "bert", "nomic-bert": "nomic_bert"}  # llama.cpp's name: transformers' model type
POOLING = {0: "mean", 1: "mean", 2: "cls", 3: "lasttoken"}  # llama.cpp's pooling types (4: rank)
PHANTOM = "\u2581"
CONTROL = 3  # llama.cpp's token type of a control token ([CLS], [SEP], [PAD], ...)

# {GGUF name: transformers name}; `{i}` is a layer. attn_qkv is split into the three projections.
_BERT = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
         "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
         "blk.{i}.attn_q": "encoder.layer.{i}.attention.self.query",
         "blk.{i}.attn_k": "encoder.layer.{i}.attention.self.key",
         "blk.{i}.attn_v": "encoder.layer.{i}.attention.self.value",
         "blk.{i}.attn_output": "encoder.layer.{i}.attention.output.dense",
         "blk.{i}.attn_output_norm": "encoder.layer.{i}.attention.output.LayerNorm",
         "blk.{i}.ffn_up": "encoder.layer.{i}.intermediate.dense",
         "blk.{i}.ffn_down": "encoder.layer.{i}.output.dense",
         "blk.{i}.layer_output_norm": "encoder.layer.{i}.output.LayerNorm"}
_NOMIC = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
          "token_embd_norm": "embeddings.LayerNorm",
          "blk.{i}.attn_q": "layers.{i}.self_attn.q_proj", "blk.{i}.attn_k": "layers.{i}.self_attn.k_proj",
          "blk.{i}.attn_v": "layers.{i}.self_attn.v_proj", "blk.{i}.attn_output": "layers.{i}.self_attn.o_proj",
          "blk.{i}.attn_output_norm": "layers.{i}.post_attention_layernorm",
          "blk.{i}.ffn_up": "layers.{i}.mlp.up_proj", "blk.{i}.ffn_gate": "layers.{i}.mlp.gate_proj",
          "blk.{i}.ffn_down": "layers.{i}.mlp.down_proj",
          "blk.{i}.layer_output_norm": "layers.{i}.post_mlp_layernorm"}
NAMES = {"bert": _BERT, "nomic-bert": _NOMIC}


def is_encoder(meta: dict[str, Any]) -> bool:
    """The GGUF (its header's scalars, tokenizer_files.gguf_metadata) holds an encoder: one served
    here, or another that says its attention is not causal (refused at start, with the reason)."""
    arch = str(meta.get("general.architecture", ""))
    return arch in ARCHITECTURES or meta.get(f"{arch}.attention.causal") is False


def write_description(gguf: Path, folder: Path) -> None:
    """The tokenizer, config and sentence-transformers modules of the GGUF encoder, into `folder`."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    config, pooling = _config(reader)
    folder.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(reader, folder, config["max_position_embeddings"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config["hidden_size"], "pooling_mode": pooling}, indent=1))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": config["max_position_embeddings"], "do_lower_case": False}, indent=1))


def write_weights(gguf: Path, folder: Path) -> None:
    """The GGUF encoder's weights, dequantised to fp32 under transformers' names, into
    `folder`/model.safetensors (with its config.json)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf)
    config, _ = _config(reader)
    arch = _field(reader, "general.architecture")
    table = _table(arch, config["num_hidden_layers"])
    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        value = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        value = value.reshape([int(d) for d in reversed(tensor.shape.tolist())])
        if base.endswith(".attn_qkv"):  # [q; k; v] rows, as llama.cpp fuses them
            layer = base.removesuffix(".attn_qkv")
            for part, rows in zip(("attn_q", "attn_k", "attn_v"), np.split(value, 3, axis=0)):
                state[f"{table[f'{layer}.{part}']}.{suffix}"] = np.ascontiguousarray(rows)
        elif base in table:
            state[f"{table[base]}.{suffix}"] = value
        elif base in ("cls", "cls.output"):
            raise UnsupportedEncoder(f"{gguf.name}: a reranker's classification head is not served from a GGUF")
        else:
            raise UnsupportedEncoder(f"{gguf.name}: the tensor {tensor.name!r} is not one of llama.cpp's "
                                     f"{arch} tensors that this server reads")
    if "embeddings.token_type_embeddings.weight" not in state:  # a file written without segments
        state["embeddings.token_type_embeddings.weight"] = np.zeros((1, config["hidden_size"]), np.float32)
        config["type_vocab_size"] = 1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def _table(arch: str, layers: int) -> dict[str, str]:
    out = {}
    for gguf_name, hf_name in NAMES[arch].items():
        if "{i}" in gguf_name:
            out.update({gguf_name.format(i=i): hf_name.format(i=i) for i in range(layers)})
        else:
            out[gguf_name] = hf_name
    return out


def _config(reader) -> tuple[dict[str, Any], str]:
    """The transformers config of the file's encoder, and its pooling mode."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedEncoder(f"GGUF architecture {arch!r} is no encoder served here ({sorted(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedEncoder(f"the GGUF has no {arch}.{name}")
        return value

    if key("attention.causal", False):
        raise UnsupportedEncoder(f"the GGUF's {arch} model has causal attention: it is no encoder")
    kind = int(key("pooling_type", 0))
    if kind not in POOLING:
        raise UnsupportedEncoder(f"the GGUF's pooling type {kind} (rank: a reranker's head) is not served from "
                                 "a GGUF; mean (1), CLS (2) and last token (3) are")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch], "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "intermediate_size": int(key("feed_forward_length")),
        "max_position_embeddings": int(key("context_length")),
        "type_vocab_size": int(_field(reader, "tokenizer.ggml.token_type_count", 2)),
        "layer_norm_eps": float(key("attention.layer_norm_epsilon")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "gguf_architecture": arch}
    if arch == "bert":
        config.update(architectures=["BertModel"], hidden_act="gelu")
    else:
        config.update(architectures=["NomicBertModel"], hidden_act="silu", head_dim=hidden // heads,
                      rope_parameters={"rope_theta": float(key("rope.freq_base", 10000.0)), "rope_type": "default"})
    return config, POOLING[kind]


def _write_tokenizer(reader, folder: Path, context: int) -> None:
    """tokenizer.json (WordPiece) and tokenizer_config.json of the file's `bert` vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if (model := _field(reader, "tokenizer.ggml.model")) != "bert":
        raise UnsupportedEncoder(f"the GGUF's tokenizer {model!r} is not served for an encoder (WordPiece, "
                                 "llama.cpp's 'bert', is)")
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    types = [int(t) for t in reader.fields["tokenizer.ggml.token_type"].contents()]
    pieces = [t if kind == CONTROL else t[1:] if t.startswith(PHANTOM) else "##" + t for t, kind in zip(tokens, types)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise UnsupportedEncoder("the GGUF's vocabulary has two tokens that read back as one WordPiece piece")

    def special(name: str, fallback: str) -> tuple[str, int]:
        index = _field(reader, f"tokenizer.ggml.{name}_token_id")
        index = vocab.get(fallback) if index is None else int(index)
        if index is None or not 0 <= index < len(pieces):
            raise UnsupportedEncoder(f"the GGUF names no {name} token (and has no {fallback})")
        return pieces[index], index

    cls, sep, unk = special("bos", "[CLS]"), special("seperator", "[SEP]"), special("unknown", "[UNK]")
    pad = special("padding", "[PAD]")
    words = [p for p, kind in zip(pieces, types) if kind != CONTROL]
    lower = _field(reader, "tokenizer.ggml.normalizer.lowercase")
    if lower is None:  # written before llama.cpp kept the normaliser's flags: uncased if no capital letter
        lower = not any(ch != ch.lower() for word in words for ch in word)
    strip = _field(reader, "tokenizer.ggml.normalizer.strip_accents", bool(lower))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk[0], max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=bool(strip), lowercase=bool(lower))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]}:0 $A:0 {sep[0]}:0", pair=f"{cls[0]}:0 $A:0 {sep[0]}:0 $B:1 {sep[0]}:1",
        special_tokens=[cls, sep])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens([p for p, kind in zip(pieces, types) if kind == CONTROL])
    tokenizer.save(str(folder / "tokenizer.json"))
    mask = _field(reader, "tokenizer.ggml.mask_token_id")
    config = {"tokenizer_class": "BertTokenizer", "cls_token": cls[0], "sep_token": sep[0], "unk_token": unk[0],
              "pad_token": pad[0], "do_lower_case": bool(lower), "model_max_length": context}
    if mask is not None:
        config["mask_token"] = pieces[int(mask)]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _field(reader, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()
