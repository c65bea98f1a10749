"""Tiny models with random weights and a small byte-level BPE tokenizer, built by the tests.

They are saved like any Hugging Face model folder and loaded through the same code as the
real model, so every test runs the real loading, batching and streaming paths in seconds.
"""
from __future__ import annotations

import json
from pathlib import Path

from shared import tokenizer_files

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's template, shortened: it renders `tools` and asks for Hermes-style <tool_call> blocks.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>{{ '\n' }}"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role + '\n' + message.content }}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}{{ '\n' + message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{{ '\n' }}<tool_call>{{ '\n' }}{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}{{ '\n' }}</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user{{ '\n' }}<tool_response>{{ '\n' + message.content + '\n' }}"
    "</tool_response><|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)
CORPUS = [
    "Once upon a time there was a small model that served many users at once.",
    "The capital of France is Paris. The capital of Korea is Seoul.",
    "Streams, batches and caches: a worker runs requests together, step by step.",
    "안녕하세요, 반갑습니다. 😀 🚀 café naïve",
] * 20
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CONTEXT = 256


def build_tokenizer(folder: Path, vocab_size: int = 400, context: int = CONTEXT,
                    chat_template: str = CHAT_TEMPLATE, special_tokens: tuple[str, ...] = ()) -> int:
    """Train the tokenizer into `folder`; return the real vocabulary size. `special_tokens`: more
    special tokens, each one token (as a real model's markers are, e.g. Mistral's [TOOL_CALLS])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "chat_template": chat_template, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
    }))
    return tok.get_vocab_size()


def build_model(folder: Path, kind: str, seed: int = 0, context: int = CONTEXT, chat_template: str = CHAT_TEMPLATE,
                special_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny 'llama', 'mistral', 'gemma3', 'phi3', 'opt' or 'gpt2' model with its tokenizer in `folder`, of
    `context` positions. gpt2 has no paged runner: it serves through the static engine."""
    import torch
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig,
                              Phi3Config)

    vocab = build_tokenizer(folder, context=context, chat_template=chat_template, special_tokens=special_tokens)
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  max_position_embeddings=context)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, initializer_range=0.2, **common)
    elif kind == "opt":
        config = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           word_embed_proj_dim=64, init_std=0.2, **common)
    elif kind == "mistral":  # a sliding window much shorter than its context, and than a prompt
        config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, initializer_range=0.2, sliding_window=13, **common)
    elif kind == "gemma3":  # local layers (window 13, rotary base 10k) around a global one (1M)
        config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=13,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  initializer_range=0.2, **common)
    elif kind == "phi3":  # q, k, v in one qkv_proj, gate and up in one gate_up_proj
        config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, initializer_range=0.2, original_max_position_embeddings=context,
                            **common)
    elif kind == "gpt2":
        config = GPT2Config(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=context, initializer_range=0.2,
                            vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    return folder


def first_layers(folder: Path, target: Path, layers: int) -> Path:
    """A draft model cut from a model: its first `layers` layers, with the same embeddings, head
    and tokenizer (an untrained early exit: a weak but honest draft)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(target)
    for name in (*tokenizer_files.TOKENIZER, "generation_config.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, target / name)
    return target


def write_shape(writer, config: dict, context: int) -> None:
    """The hyperparameters every architecture's GGUF header has, from a transformers config."""
    writer.add_context_length(context)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])


def finish(writer) -> None:
    """Write the GGUF's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(model: Path, path: Path, context: int = 256, qtype: str = "F32") -> Path:
    """The tiny llama (or phi3) of `model` as a GGUF file: its BPE vocabulary, the chat template, and its
    tensors in F32, or with every 2-D weight (projections, embedding, head) in `qtype` (Q8_0, Q4_0,
    Q5_0, ...: the block types gguf-py quantizes) and the norms in F32."""
    import gguf
    import torch
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((model / "config.json").read_text())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    special = {t["content"] for t in tokenizer["added_tokens"]}
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape(writer, config, context)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for name, tensor in load_file(model / "model.safetensors").items():
        data, kind = tensor.to(torch.float32).numpy(), gguf.GGMLQuantizationType[qtype]
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data)
    finish(writer)
    return path
